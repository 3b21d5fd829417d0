"""The model card an MLM encoder carries when it is logged as an MLflow transformers model
(`Model(..., card=model_card)` in the flows that log one): the stage's own model_card.md under card data
that names the warm start as the base model with the licence its card declares. Apart from flows/_stage.py,
so that only those flows import the warm start's resolution (components/models/encoder.py)."""

from __future__ import annotations

import functools
from pathlib import Path

from components.config import Params
from components.tracking import StageRun


def _warm_start_licence(params: Params) -> str | None:
    """The licence the warm start's own model card declares, or None (no warm start, no card, none declared)."""
    from components.models.encoder import warm_start_path

    try:
        spec = warm_start_path(params)
    except ValueError:
        return None
    return None if spec is None else _declared_licence(spec)


@functools.cache  # per resolved warm start: a stage logs several models from one (retromae and init)
def _declared_licence(spec: str) -> str | None:
    """The licence in the model card (README.md) of the folder `spec`, or of a hub model already in the
    local HF cache (never a download)."""
    from huggingface_hub import ModelCard, try_to_load_from_cache

    readme: Path | None = Path(spec) / "README.md"
    try:
        if not Path(spec).exists():  # a hub name: its README only if already in the local HF cache
            cached = try_to_load_from_cache(spec, "README.md")
            readme = Path(cached) if isinstance(cached, str) else None
        card = ModelCard.load(str(readme)) if readme is not None and readme.is_file() else None
    except Exception:  # noqa: BLE001 - no card, or one that does not parse: no licence to pass on
        return None
    return getattr(card.data, "license", None) if card is not None else None


def model_card(run: StageRun, path: Path, name: str, task: str | None):
    """The model card MLflow's transformers flavor stores with a logged model (its model_card.md and
    model_card_data.yaml): the stage's own model_card.md (in the folder or beside it) under metadata that names
    the warm start as the base model and carries its declared licence. Without a card MLflow asks the
    HF hub for one under the folder's path and warns twice per model."""
    from huggingface_hub import ModelCard, ModelCardData

    license_ = _warm_start_licence(run.params)
    data = run.params.data
    corpus = f"`data.source: {data.source}`" + (f", `data.path: {data.path}`" if data.path else "")
    terms = Path(data.path) / "LICENSE" if data.path else None  # a corpus folder's own (the shipped slice has one)
    if terms is not None and terms.is_file():
        corpus += f"; its terms: `{terms}`"
    body = next((f.read_text() for f in (path / "model_card.md", path.parent / "model_card.md") if f.is_file()),
                f"# {name}\n\nLogged by retro-realm's `{run.stage}` stage from `{path}`.\n")
    body += ("\n## Licence\n\n" + (f"`{license_}`, as the warm start's model card declares it (`warm_start.path`: "
                                       f"`{run.params.warm_start.path}`). " if license_ else "None declared. ")
             + f"The training corpus's licence applies too ({corpus}).\n")
    meta = ModelCardData(license=license_, base_model=run.params.warm_start.path, library_name="transformers",
                         pipeline_tag=task, tags=["retro-realm", run.stage])
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n{body}")
