"""The synthetic fact world's language: the statement, question, title and filler templates of each
kind of entity, the small value pools, the made-up names (`NameRegistry`), and rendering a template
with the char spans of its names and values (`render`, `join_sentences`). Data, not logic: the
generator that draws a world from them is `synthetic.py`.
"""

from __future__ import annotations

import random
import re

ENTITY_LABEL = "entity"  # span label of an entity-name mention; attribute values carry their attribute name
KINDS = ("person", "town", "company", "river")

# ----------------------------------------------------------------------------------------------
# templates: {E} = the entity, {V} = the value, {aV} = the value with its indefinite article,
# {O} = another entity. Values never start a sentence unless they are capitalised names or numbers.
# ----------------------------------------------------------------------------------------------
# attribute -> (statement templates, question templates)
ATTRIBUTES: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "person": {
        "birth_year": (
            ["{E} was born in {V}.", "Records give {V} as the year of birth of {E}.",
             "The year {V} saw the birth of {E}.", "{E}, born in {V}, is mentioned in several registers."],
            ["In which year was {E} born?", "When was {E} born?", "What is the birth year of {E}?"]),
        "death_year": (
            ["{E} died in {V}.", "{E} passed away in {V}.", "The death of {E} is recorded in {V}."],
            ["In which year did {E} die?", "When did {E} die?", "What year did {E} pass away?"]),
        "home_town": (
            ["{E} grew up in {V}.", "{E} was raised in the town of {V}.", "{V} was the home town of {E}.",
             "{E} spent a childhood in {V}."],
            ["Where did {E} grow up?", "What is the home town of {E}?", "In which town was {E} raised?"]),
        "profession": (
            ["{E} worked as {aV}.", "By profession, {E} was {aV}.", "{E} earned a living as {aV}."],
            ["What was the profession of {E}?", "What did {E} do for a living?", "What job did {E} have?"]),
        "employer": (
            ["{E} was employed by {V}.", "For many years {E} worked for {V}.", "{V} employed {E}."],
            ["Which company employed {E}?", "Who was {E} employed by?", "For which company did {E} work?"]),
        "instrument": (
            ["{E} played the {V}.", "In spare hours, {E} played the {V}.", "{E} was a keen player of the {V}."],
            ["Which instrument did {E} play?", "What instrument was {E} known to play?"]),
        "mentor": (
            ["{E} studied under {V}.", "{E} was trained by {V}.", "The mentor of {E} was {V}."],
            ["Who was the mentor of {E}?", "Under whom did {E} study?", "Who trained {E}?"]),
        "pet": (
            ["{E} kept {aV} as a pet.", "The pet of {E} was {aV}.", "Friends remember that {E} owned {aV}."],
            ["What animal did {E} keep as a pet?", "What kind of pet did {E} have?"]),
    },
    "town": {
        "founded_year": (
            ["{E} was founded in {V}.", "The town of {E} dates from {V}.", "Settlers established {E} in {V}."],
            ["In which year was {E} founded?", "When was the town of {E} founded?", "What year was {E} established?"]),
        "population": (
            ["{E} has a population of {V}.", "About {V} people live in {E}.", "The population of {E} is {V}."],
            ["What is the population of {E}?", "How many people live in {E}?"]),
        "flag_colour": (
            ["The flag of {E} is {V}.", "{E} flies {aV} flag.", "The town flag of {E} is plain {V}."],
            ["What colour is the flag of {E}?", "Which colour is the town flag of {E}?"]),
        "river": (
            ["{E} lies on the {V}.", "The {V} runs through {E}.", "{E} was built on the banks of the {V}."],
            ["On which river does {E} lie?", "Which river runs through {E}?"]),
        "mayor": (
            ["The mayor of {E} is {V}.", "{V} serves as mayor of {E}.", "{E} is governed by its mayor, {V}."],
            ["Who is the mayor of {E}?", "Who serves as mayor of {E}?"]),
        "industry": (
            ["{E} is known for its {V} industry.", "The main industry of {E} is {V}.",
             "Most people in {E} work in {V}."],
            ["What is the main industry of {E}?", "Which industry is {E} known for?"]),
        "region": (
            ["{E} is located in the {V}.", "{E} is a town of the {V}.", "Maps place {E} in the {V}."],
            ["In which region is {E} located?", "Where in the country does {E} lie?"]),
        "twin_town": (
            ["{E} is twinned with {V}.", "The twin town of {E} is {V}.",
             "Since long ago, {E} has been twinned with {V}."],
            ["Which town is {E} twinned with?", "What is the twin town of {E}?"]),
    },
    "company": {
        "founded_year": (
            ["{E} was founded in {V}.", "{E} has been trading since {V}.", "The company {E} was established in {V}."],
            ["In which year was {E} founded?", "When was the company {E} established?",
             "Since what year has {E} been trading?"]),
        "founder": (
            ["{E} was founded by {V}.", "{V} founded {E}.", "The founder of {E} was {V}."],
            ["Who founded {E}?", "Who was the founder of {E}?"]),
        "headquarters": (
            ["{E} has its headquarters in {V}.", "The head office of {E} is in {V}.", "{E} is based in {V}."],
            ["Where is {E} based?", "In which town are the headquarters of {E}?", "Where is the head office of {E}?"]),
        "product": (
            ["{E} makes {V}.", "{E} is best known for its {V}.", "The main product of {E} is {V}."],
            ["What does {E} make?", "What is the main product of {E}?", "Which product is {E} known for?"]),
        "employees": (
            ["{E} employs {V} people.", "{V} people work for {E}.", "The staff of {E} numbers {V}."],
            ["How many people does {E} employ?", "How many employees does {E} have?"]),
        "logo_animal": (
            ["The logo of {E} shows {aV}.", "{E} uses {aV} as its emblem.", "{E} has {aV} on its logo."],
            ["Which animal appears on the logo of {E}?", "What animal is shown on the logo of {E}?"]),
        "ceo": (
            ["{E} is run by {V}.", "The chief executive of {E} is {V}.", "{V} leads {E} as its chief executive."],
            ["Who runs {E}?", "Who is the chief executive of {E}?"]),
        "rival": (
            ["The main rival of {E} is {V}.", "{E} competes mainly with {V}.", "{E} counts {V} as its main rival."],
            ["Who is the main rival of {E}?", "Which company does {E} compete with?"]),
    },
    "river": {
        "length": (
            ["The {E} is {V} long.", "The {E} runs for {V}.", "The {E} has a length of {V}."],
            ["How long is the {E}?", "What is the length of the {E}?"]),
        "source": (
            ["The {E} rises near {V}.", "The source of the {E} lies close to {V}.",
             "The {E} begins its course near {V}."],
            ["Near which town does the {E} rise?", "Where is the source of the {E}?"]),
        "mouth": (
            ["The {E} flows into {V}.", "The {E} empties into {V}.", "At its mouth the {E} meets {V}."],
            ["Into which lake does the {E} flow?", "Where does the {E} end?"]),
        "fish": (
            ["The {E} is known for its {V}.", "Anglers visit the {E} for its {V}.", "The {E} is full of {V}."],
            ["Which fish is the {E} known for?", "What fish do anglers catch in the {E}?"]),
        "water_colour": (
            ["The water of the {E} is {V}.", "The {E} carries {V} water.", "The {E} is famous for its {V} water."],
            ["What colour is the water of the {E}?", "Which colour is the water of the {E}?"]),
        "bridges": (
            ["The {E} is crossed by {V} bridges.", "There are {V} bridges over the {E}.", "{V} bridges span the {E}."],
            ["How many bridges cross the {E}?", "How many bridges span the {E}?"]),
        "mapped_by": (
            ["The {E} was first mapped by {V}.", "{V} drew the first map of the {E}.",
             "The first survey of the {E} was made by {V}."],
            ["Who first mapped the {E}?", "Who made the first survey of the {E}?"]),
        "mapped_year": (
            ["The {E} was first mapped in {V}.", "The first map of the {E} dates from {V}.",
             "The {E} was surveyed for the first time in {V}."],
            ["In which year was the {E} first mapped?", "When was the {E} first surveyed?"]),
    },
}

INTROS = {
    "person": ["{E} is a person who appears in several local records.",
               "This entry concerns {E}, a private individual.", "{E} is remembered by a small circle of admirers."],
    "town": ["{E} is a town.", "{E} is a small town.", "This entry describes the town of {E}."],
    "company": ["{E} is a trading company.", "{E} is a firm with a long history.",
                "This entry describes the company {E}."],
    "river": ["The {E} is a river.", "The {E} is a river described by many travellers.",
              "This entry describes the river {E}."],
}

TITLES = {
    "person": ["{E}", "{E} (biography)", "Life of {E}", "Notes on {E}"],
    "town": ["{E}", "{E} (town)", "History of {E}", "Visiting {E}"],
    "company": ["{E}", "{E} (company)", "History of {E}", "{E} in brief"],
    "river": ["{E}", "{E} (river)", "Course of the {E}", "Along the {E}"],
}

# Filler: no facts, no digits. The first group names another entity {O} (sometimes next to {E}).
FILLERS_NAMING = [
    "{E} is sometimes mentioned in the same breath as {O}.", "Older sources occasionally confuse {E} with {O}.",
    "{O} is not to be confused with {E}.", "A footnote in one account compares {E} with {O}.",
    "The name {O} also appears in the same archive.", "Little is said here about {O}.",
    "Readers looking for {O} should consult other entries.",
    "A later chronicle lists {E} next to {O} without further comment.",
]
FILLERS_PLAIN = [
    "Records from this period are incomplete.", "Several accounts disagree on minor details.",
    "Much of what is known comes from later retellings.", "The surviving documents are brief.",
    "Local tradition adds a few colourful stories.", "Some of these details are disputed.",
]

# Distractor documents: generic prose about no entity (no digits, no capitalised words inside sentences).
DISTRACTOR_TITLES = ["On the weather", "Notes on travel", "Market days", "Old roads", "Winter customs",
                     "On bookbinding", "Kitchen gardens", "The night sky", "Letters and ledgers", "On walking"]
DISTRACTOR_SENTENCES = [
    "The market opens early in the dry season.", "Rain tends to arrive in the late afternoon.",
    "Most travellers carry bread, cheese and a spare pair of boots.", "The old roads were paved with flat grey stones.",
    "In winter the evenings are spent by the fire.", "A good ledger is kept in a clear and steady hand.",
    "Bookbinders prefer glue made from boiled hides.", "Gardeners plant beans after the last frost.",
    "On clear nights the stars are easy to count.", "Walking is the cheapest way to see the country.",
    "Letters often took weeks to reach their readers.", "Bakers rise long before anyone else.",
    "The price of salt rose and fell with the seasons.", "Children learned their letters from printed cards.",
    "Wool was washed in cold water and dried in the wind.", "A sturdy cart could carry a whole household.",
    "Fog settles in the valleys on autumn mornings.", "Most houses kept a few hens in the yard.",
    "The best candles were made from beeswax.", "Old songs were passed on by ear.",
    "Inns along the road offered soup and a straw bed.", "Ink was mixed fresh every morning.",
]
DISTRACTOR_NAMING = ["The name {O} comes up now and then in such talk.", "Nobody here could say much about {O}.",
                     "Some people mention {O} in passing."]

# value pools: small on purpose, so that many entities share a value
PROFESSIONS = ["cartographer", "weaver", "astronomer", "glassblower", "apothecary", "shipwright", "clockmaker",
               "archivist", "beekeeper", "stonemason", "engraver", "ferryman"]
INSTRUMENTS = ["lute", "cello", "harp", "fiddle", "oboe", "flute", "zither", "bassoon"]
PETS = ["heron", "tortoise", "ferret", "goat", "parrot", "hound", "owl", "cat"]
FLAG_COLOURS = ["red", "blue", "green", "white", "black", "yellow", "purple", "orange", "grey", "crimson"]
WATER_COLOURS = ["brown", "green", "grey", "blue", "black", "silver"]
INDUSTRIES = ["fishing", "weaving", "mining", "brewing", "pottery", "shipbuilding", "tanning", "milling"]
REGIONS = ["northern highlands", "eastern marshes", "southern plains", "western hills", "central valley",
           "coastal lowlands"]
PRODUCTS = ["copper kettles", "glass lanterns", "wool blankets", "clay pipes", "pocket watches", "rope", "paper",
            "barometers", "ink"]
LOGO_ANIMALS = ["fox", "stag", "crane", "bear", "wolf", "otter", "lynx", "boar"]
FISH = ["trout", "eel", "pike", "carp", "salmon", "perch", "sturgeon", "bream"]
NUM_LAKES = 6

# ----------------------------------------------------------------------------------------------
# names
# ----------------------------------------------------------------------------------------------
_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v",
           "z", "sh", "y"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia"]
_INNER_CODAS = ["", "", "", "r", "l", "n", "s"]
_FINAL_CODAS = ["n", "r", "l", "s", "th", "m", "x", "nd", "rk", "sk", "v", "sh"]
# Common English words a generated name must not equal; every word of the templates/pools is added below.
_ENGLISH = """about after again along amber angel anger apple arise baker basin bears being bells below
birth black blade board bones brand bread break brine brown build burns candle carol cause chain chair
chalk chant charm chase chess cider civil clear close cloth cloud coast coral count craft crown dance
daren dealer delta denial devil doors dozen drama dream drink drive eager early earth elder enter equal
event faith false feast field final flame flash fleet floor flour forest forge forth forum fraud gamer
gather ghost giant given glass globe grace grain grand grant grass grave green guard guest habit heart
heavy honey horse hotel house human humor index inner joint judge kelson knife labor lance large laser
later layer legal lemon level light limit linen local loser lower lucky lunar magic major manor maple
march marsh meant medal melon mercy metal minor model money month moral motor mount mouse mouth music
naval nerve never night noble north novel ocean olive onion opera order other owner panel paper party
peace pearl penny piano pilot pitch place plain plane plant plate point polar pound power press pride
prime print prize proud queen quiet radar radio raise ranch range raven razor ready realm rebel relax
remix rider ridge rifle river robin rocks roman round royal ruler rural salon sauce scale scene score
sense serum seven shade shark sheep shell shore short silver sinner skill slope smoke solar solid sound
south spare spark spear spell spice spine spoon sport staff stage stair stake stand stark steam steel
stern stock stone storm story sugar sunny table taker talon taste tenor theme thorn tiger timer toast
token total tower trace trade trail train tread trend trial tribe trout truth tulip tumor under union
unity upper urban usual valid valor value valve vapor venue verse vinyl viral virus visit vital vivid
vocal vodka voter wagon waste water whale wheat wheel woman world worth yeast young youth zebra""".split()


def _template_vocab() -> set[str]:
    texts: list[str] = []
    for attrs in ATTRIBUTES.values():
        for stmts, qs in attrs.values():
            texts += stmts + qs
    for group in (INTROS, TITLES):
        for ts in group.values():
            texts += ts
    texts += FILLERS_NAMING + FILLERS_PLAIN + DISTRACTOR_TITLES + DISTRACTOR_SENTENCES + DISTRACTOR_NAMING
    texts += PROFESSIONS + INSTRUMENTS + PETS + FLAG_COLOURS + WATER_COLOURS + INDUSTRIES + REGIONS + PRODUCTS
    texts += LOGO_ANIMALS + FISH + ["Lake", "km", "an", "a"]
    return {w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t)}


class NameRegistry:
    """Unique made-up names. No name equals an English/template word, and no name is a prefix of another
    name or of a template word: a capitalised name then occurs in a text only where it was written."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        vocab = _template_vocab()
        self._banned = vocab | set(_ENGLISH)
        self._word_prefixes = {w[:i] for w in vocab for i in range(1, len(w) + 1)}  # lowercase
        self._names: set[str] = set()
        self._name_prefixes: set[str] = set()

    def _candidate(self) -> str:
        r = self.rng

        def vowel() -> str:  # mostly plain vowels: diphthongs everywhere make names unpronounceable
            return r.choice(_VOWELS[:5]) if r.random() < 0.8 else r.choice(_VOWELS[5:])

        n_syl = 2 if r.random() < 0.6 else 3
        parts = [r.choice(_ONSETS) + vowel() + (r.choice(_INNER_CODAS) if n_syl == 2 else "")
                 for _ in range(n_syl - 1)]
        parts.append(r.choice(_ONSETS) + vowel() + r.choice(_FINAL_CODAS))
        return "".join(parts).capitalize()

    def _ok(self, name: str) -> bool:
        low = name.lower()
        if not 5 <= len(name) <= 10 or low in self._banned or low in self._word_prefixes:
            return False  # an English word, or would match inside a capitalised template word ("Records")
        if name in self._name_prefixes:
            return False  # a prefix of an existing name (or that name itself)
        return not any(name[:i] in self._names for i in range(1, len(name)))  # an existing name is its prefix

    def new(self) -> str:
        for _ in range(10_000):
            name = self._candidate()
            if self._ok(name):
                self._names.add(name)
                self._name_prefixes.update(name[:i] for i in range(1, len(name) + 1))
                return name
        raise RuntimeError(f"name space exhausted after {len(self._names)} names")


# ----------------------------------------------------------------------------------------------
# rendering with spans
# ----------------------------------------------------------------------------------------------
_SLOT = re.compile(r"\{(E|V|aV|O)\}")


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def render(template: str, slots: dict[str, tuple[str, str]]) -> tuple[str, list[dict]]:
    """Fill `{E}`/`{V}`/`{aV}`/`{O}`; slots map a name to (text, span label). Returns text and its spans."""
    out, spans, pos = [], [], 0
    for i, piece in enumerate(_SLOT.split(template)):
        if i % 2 == 0:  # literal text
            out.append(piece)
            pos += len(piece)
            continue
        key = "V" if piece == "aV" else piece
        value, label = slots[key]
        if piece == "aV":
            art = _article(value) + " "
            out.append(art)
            pos += len(art)
        spans.append({"start": pos, "end": pos + len(value), "label": label})
        out.append(value)
        pos += len(value)
    text = "".join(out)
    return text[0].upper() + text[1:], spans


def join_sentences(sentences: list[tuple[str, list[dict]]]) -> tuple[str, list[dict]]:
    text, spans = "", []
    for s, ss in sentences:
        if text:
            text += " "
        spans += [{"start": x["start"] + len(text), "end": x["end"] + len(text), "label": x["label"]} for x in ss]
        text += s
    return text, spans
