"""Typed view of `params.yaml`: loaded and validated once, one section per stage.

    from components.config import load_params
    p = load_params()                                    # ./params.yaml
    p = load_params("params.yaml", overrides={"retromae.train.max_steps": 5})

Every knob of the pipeline is typed in these modules; its value lives in `params.yaml` only.
`load_params` needs every key spelled out there, and unknown keys, wrong types and out-of-range
values raise `ParamsError`, whose message names the dotted key, what was given and what is allowed;
a key params.yaml no longer has (`config_file.REMOVED_KEYS`) says what replaces it.

A section built in code (`RealmParams(top_k=4)`, in tests and tools) takes the keys it is not given
from the repo's `params.yaml` (the default), so every value is written in one place.

The trainer knobs every training stage shares (weight decay, Adam, warm-up ratio, clipping, checkpoints
kept, ...) are written once, in the `trainer` group; each stage's trainer block (`retromae.train`,
`realm.train`, `finetune.train`, `finetune.qa_train`) holds its own keys and may set a shared one, which
then overrides the group for that stage only. `load_params` fills the blocks after presets and
overrides are applied, so `p.realm.train.weight_decay` is what REALM trains with.

Presets (`params/tiny.yaml`, `params/small.yaml`, `params/paper.yaml`) are partial files. The pipeline writes one into
`params.yaml` as `dvc exp run -S` overrides (`python -m flows.pipeline --preset paper`), so DVC sees
every value a stage ran with; `load_params(presets=[...])` merges one in memory for tests and tools.

The sections are `components.config_shared` (the base and the sub-sections several stages share) and
`components.config_stages` (one per stage); reading a file is `components.config_file`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError, model_validator

from components.config_file import (PARAMS_FILE, TRAIN_BLOCKS, TRAINER, ParamsError, inherit_trainer, inherited_keys,
                                    read_yaml, removed_key_message)
from components.config_shared import (ComputeParams, Section, TrackingParams, TrainerParams, WarmStartParams, batch_keys,
                                      batch_split_error)
from components.config_stages import (DataParams, EvaluateParams, FinetuneParams, MLMParams, RealmParams,
                                      RetroMAEParams, TokenizeParams)

ENV_PRESETS = "RETRO_REALM_PRESETS"  # refused: a preset merged at load time is invisible to DVC


class _Unset:
    """An override value that removes the key (`dvc exp run -S '~key'`): a stage's trainer block then
    takes it from the `trainer` group again."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class Params(Section):
    defaults_from: ClassVar[str | None] = ""
    compute: ComputeParams
    tracking: TrackingParams
    warm_start: WarmStartParams
    trainer: TrainerParams
    data: DataParams
    tokenize: TokenizeParams
    retromae: RetroMAEParams
    mlm: MLMParams
    realm: RealmParams
    finetune: FinetuneParams
    evaluate: EvaluateParams

    @model_validator(mode="after")
    def _check_block_lengths(self) -> "Params":
        # tokenize.retrieval_block_len counts a block's tokens without [CLS]/[SEP]; realm.block_len
        # counts the reader's / document tower's input with them: a shorter block_len cuts every full block.
        need = self.tokenize.retrieval_block_len + 2
        if self.realm.block_len < need:
            raise ValueError(f"realm.block_len={self.realm.block_len} (incl. [CLS]/[SEP]) is shorter than "
                             f"tokenize.retrieval_block_len={self.tokenize.retrieval_block_len} (without them) + 2 = {need}: "
                             f"every full block would lose {need - self.realm.block_len} token(s); set realm.block_len >= {need} "
                             f"or tokenize.retrieval_block_len <= {self.realm.block_len - 2}")
        return self

    def train_phases(self) -> list[str]:
        """The training phases these params run, by their Trainer's `param_prefix` (`batch_keys` names
        each one's batch and grad_accum keys)."""
        r, ft = self.realm, self.finetune
        return ["retromae.train", "realm.train", "finetune.train",
                *(["realm.ict"] if r.ict_steps else []), *(["realm.reader_warmup"] if r.reader_warmup_steps else []),
                *(["finetune.qa_gold"] if ft.qa_enabled and ft.qa_gold_steps else []),
                *(["finetune.qa_train"] if ft.qa_enabled else [])]

    def value(self, key: str) -> Any:
        """The value at a dotted key (`realm.train.grad_accum`)."""
        node: Any = self
        for part in key.split("."):
            node = getattr(node, part)
        return node

    @model_validator(mode="after")
    def _check_batches_split(self) -> "Params":
        # Each phase cuts its global batch into nproc x nnodes ranks x grad_accum micro-batches. Checked
        # here so that a batch that does not divide fails when params load, not minutes into a stage.
        world = self.compute.nproc * self.compute.nnodes
        errors = [why for phase in self.train_phases()
                  if (why := batch_split_error(phase, *map(self.value, batch_keys(phase)), world))]
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def section_digest(self, *sections: str) -> str:
        """sha256 over the named sections (all when none): tags runs with what they were given."""
        names = sections or tuple(type(self).model_fields)
        blob = json.dumps({s: getattr(self, s).model_dump(mode="json") for s in names}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(raw: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys (`{"retromae.train.max_steps": 5}`), as `dvc exp run -S` does; `UNSET` removes one."""
    out = copy.deepcopy(raw)
    for dotted, value in (overrides or {}).items():
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ParamsError(f"override {dotted!r}: {p!r} is not a section")
        if value is UNSET:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


_NAMES_ITS_KEY = re.compile(r"^[a-z_]+(\.[a-z_]+)+=")


def _format_errors(err: ValidationError, source: str, inherited: dict[str, str] | None = None) -> str:
    """One line per invalid key. A value a trainer block takes from the `trainer` group is named once,
    at the group (`inherited`: {`<block>.<key>`: `trainer.<key>`}, validated with the same bounds), not
    again in every block that does not set it."""
    inherited = inherited or {}
    errors = [(".".join(str(x) for x in e["loc"]) or "<root>", e) for e in err.errors()]
    at_group = {key for key, _ in errors if key == TRAINER or key.startswith(TRAINER + ".")}
    lines = []
    for key, e in errors:
        block, _, leaf = key.rpartition(".")
        shared_key = block in TRAIN_BLOCKS and leaf in TrainerParams.model_fields
        said_at_group = inherited.get(key) in at_group or (
            shared_key and e["type"] == "missing" and bool(at_group & {TRAINER, f"{TRAINER}.{leaf}"}))
        if said_at_group:
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            parent = _model_at(e["loc"][:-1])
            allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
            msg = removed_key_message(key) or f"unknown key; allowed keys here: {allowed}"
        elif e["type"] == "missing" and key == TRAINER:
            msg = (f"missing; the trainer knobs every training stage shares ({', '.join(TrainerParams.model_fields)}) "
                   f"are written once in `{TRAINER}`, a stage's train block overriding any (the repo's {PARAMS_FILE} has it)")
        elif e["type"] == "missing" and shared_key:
            msg = f"missing; a shared trainer knob: set it in `{TRAINER}` (every training stage) or here (this stage only)"
        elif e["type"] == "missing":
            msg = f"missing; {PARAMS_FILE} spells out every knob (the repo's {PARAMS_FILE} has each one with the default's value)"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        elif e["type"] == "value_error":
            # a validator's message, one line per key it names (`key=value ...`): listed as they are
            found = msg.removeprefix("Value error, ").splitlines()
            if all(_NAMES_ITS_KEY.match(line) for line in found):
                lines += [f"  - {line}" for line in found]
                continue
        lines.append(f"  - {key}: {msg}")
    return "\n".join([f"{source}: {len(lines)} invalid param(s):", *lines])


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Params
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def load_params(
    path: str | os.PathLike = PARAMS_FILE,
    overrides: dict[str, Any] | None = None,
    presets: list[str | os.PathLike] | None = None,
) -> Params:
    """Read params.yaml (+ preset files, + dotted overrides) and validate it into `Params`."""
    path = Path(path)
    if os.environ.get(ENV_PRESETS):
        raise ParamsError(f"{ENV_PRESETS} is set: a preset merged when params load is invisible to DVC. Write it into "
                          f"{PARAMS_FILE} instead: `python -m flows.pipeline --preset paper` (or `make run PRESET=paper`)")
    raw = read_yaml(path)
    for preset in presets or []:
        raw = _deep_merge(raw, read_yaml(Path(preset)))
    raw = apply_overrides(raw, overrides)
    try:
        # strict: every key comes from the file; a missing one is an error, never a value from elsewhere
        return Params.model_validate(inherit_trainer(raw), context={"strict": True})
    except ValidationError as e:
        raise ParamsError(_format_errors(e, str(path), inherited_keys(raw))) from None
