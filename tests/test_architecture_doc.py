"""docs/architecture.md's module map matches the code, and the README and docs pages link nothing a clone lacks.

The map is the `## Module map` section: bold package lines, each followed by a table whose first
column names one module per row:

    **`components/training/`**              rows name a file of that package: `memory.py`
    **`components/index/` and `components/retrieval/`**
                                            several packages: rows are relative to their common
                                            folder (`components/`): `index/shard.py`
    **Bottom layer** (no package named)     rows name the file from the repo root: `components/io.py`

A row that starts with `components/` or `flows/` is always read from the repo root (the stages
table's `components/tracking.py`). `flows/<stage>.py` stands for every flow that a `dvc.yaml` stage
runs (`cmd: scripts/py -m flows.<name>`). Pure text parsing: no project import, no subprocess.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MAP_HEADING = "## Module map"
ROOTS = ("components/", "flows/")

_PACKAGE = re.compile(r"`((?:components|flows)(?:/[^`/]+)*/)`")  # a package in a bold line: `components/data/`
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")  # a table row whose first cell is one backticked name
_STAGE_FLOW = re.compile(r"^\s*cmd:.*-m\s+flows\.(\w+)", re.M)


def map_section(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the `## Module map` section, up to the next `## ` heading."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == MAP_HEADING)
    except StopIteration:
        raise AssertionError(f"{DOC.relative_to(ROOT)} has no '{MAP_HEADING}' section") from None
    out = []
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("## "):
            break
        out.append((i + 1, lines[i]))
    return out


def module_map(text: str) -> dict[str, tuple[int, str]]:
    """{module path from the repo root: (doc line, the package heading it is under)}."""
    found: dict[str, tuple[int, str]] = {}
    base: str | None = None
    heading = "(none)"
    for lineno, line in map_section(text):
        stripped = line.strip()
        if stripped.startswith("**"):
            heading = stripped
            packages = [p.rstrip("/") for p in _PACKAGE.findall(stripped.split("**")[1])]
            base = os.path.commonpath(packages) if packages else None
            continue
        m = _ROW.match(stripped)
        if not m or m.group(1) == "module":
            continue
        name = m.group(1)
        if name.startswith(ROOTS):
            path = name
        else:
            assert base is not None, (f"{DOC.name}:{lineno}: row `{name}` is under '{heading}', which names no "
                                      "package: write the path from the repo root (`components/...`)")
            path = f"{base}/{name}"
        assert path not in found, f"{DOC.name}:{lineno}: `{path}` is in the map twice (also line {found[path][0]})"
        found[path] = (lineno, heading)
    return found


def _doc_map() -> dict[str, tuple[int, str]]:
    return module_map(DOC.read_text(encoding="utf-8"))


def _modules(package: str) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def _where_to_add(path: str) -> str:
    parent = path.rsplit("/", 1)[0]
    if parent == "components":
        return "the **Bottom layer** table (or the table of its layer), as `components/<file>.py`"
    return f"the table under the bold line naming `{parent}/` (or its parent package)"


def test_every_component_module_is_in_the_map():
    mapped = _doc_map()
    missing = [m for m in _modules("components") if m not in mapped]
    assert not missing, (
        f"modules under components/ missing from the '{MAP_HEADING}' of docs/architecture.md "
        "(add a row `| `<file>` | what it owns |`):\n"
        + "\n".join(f"  {m}: in {_where_to_add(m)}" for m in missing))


def test_every_flow_module_is_in_the_map():
    mapped = _doc_map()
    stage_flows = set(_STAGE_FLOW.findall((ROOT / "dvc.yaml").read_text(encoding="utf-8")))
    placeholder = "flows/<stage>.py" in mapped
    missing = [m for m in _modules("flows")
               if m not in mapped and not (placeholder and Path(m).stem in stage_flows)]
    assert not missing, ("modules under flows/ missing from the **`flows/`** table of docs/architecture.md: "
                         f"{missing}")


def test_every_module_in_the_map_exists():
    stale = [f"{path} (docs/architecture.md:{lineno}, under {heading})"
             for path, (lineno, heading) in _doc_map().items()
             if "<" not in path and not (ROOT / path).is_file()]
    assert not stale, "rows of the module map name modules that do not exist (remove or rename them):\n  " + \
        "\n  ".join(stale)


def test_the_map_covers_both_packages_and_parses():
    """Guards the parser itself: a heading format change must not make the checks above vacuous."""
    mapped = _doc_map()
    assert "components/training/memory.py" in mapped
    assert "components/index/shard.py" in mapped and "components/retrieval/bm25.py" in mapped
    assert "components/config.py" in mapped and "components/tracking.py" in mapped
    assert "flows/_stage.py" in mapped


def test_module_map_parser_on_a_small_page():
    page = "\n".join([
        "## Module map", "", "**Bottom layer**", "", "| module | owns |", "|---|---|", "| `components/io.py` | io |", "",
        "**`components/a/` and `components/b/`**: two", "", "| module | owns |", "|---|---|",
        "| `a/x.py` | x |", "| `b/y.py` | y |", "",
        "**`components/c/`** (with `components/t.py`)", "", "| `z.py` | z |", "| `components/t.py` | t |", "",
        "## Next", "| `ignored.py` | not in the map |",
    ])
    assert set(module_map(page)) == {"components/io.py", "components/a/x.py", "components/b/y.py",
                                     "components/c/z.py", "components/t.py"}


# Link targets of `[text](target)` and backticked relative paths such as `../x/y.md`.
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_DOTTED = re.compile(r"`(\.\.?/[^`\s]*)`")


# The READMEs and every docs page: a user's clone has only the repository (no folder beside it) and no absolute paths.
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "experiments" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_page_links_nothing_outside_the_repo(page):
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in _LINK.findall(text) + _DOTTED.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on this page
        path = target.split("#", 1)[0]
        if path.startswith("/"):
            bad.append(f"{target}: an absolute path")
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif resolved.relative_to(ROOT).parts[:1] == ("shared",):
            bad.append(f"{target}: shared/ is not part of a clone of the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file in the repository")
    assert not bad, (f"{page.relative_to(ROOT)} links paths a clone of the repository does not have:\n  "
                     + "\n  ".join(bad))


def test_the_link_check_covers_the_readme_and_the_docs():
    """Guards the page list: the README and the architecture page are always checked."""
    assert ROOT / "README.md" in PAGES and DOC in PAGES and len(PAGES) > 5
