"""Shared fixtures. Tests load the real params.yaml and shrink it (lightning-hydra-template style),
so a renamed or mistyped knob breaks the tests, not only the pipeline."""

from __future__ import annotations

import os
from pathlib import Path

# Keep test processes small and offline on 2-core machines (set before torch / HF are imported).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flows  # noqa: E402,F401  (the pipeline's own no-telemetry / quiet env defaults)
import pytest  # noqa: E402

from components import paths  # noqa: E402
from components.config import Params, load_params  # noqa: E402
from flows.set_params import preset_overrides  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The real servers (S3, MLflow, Prefect), started on free loopback ports by session fixtures.
pytest_plugins = ["tests.servers"]

# params.yaml is the real-text default; the tests run the tiny preset (params/tiny.yaml: the synthetic
# world, encoders from config), shrunk further by these overrides so that every stage runs in seconds.
TINY_PRESET = ROOT / "params" / "tiny.yaml"
TINY = {
    **preset_overrides(str(TINY_PRESET)),
    "data.synthetic.num_entities": 24,
    "data.synthetic.distractor_docs": 8,
    "data.synthetic.questions_per_entity": 2,
    "tokenize.vocab_size": 400,
    "tokenize.min_frequency": 1,
    "tokenize.pretrain_block_len": 62,
    "tokenize.retrieval_block_len": 48,
    "retromae.encoder.hidden_size": 32,
    "retromae.encoder.num_layers": 1,
    "retromae.encoder.intermediate_size": 64,
    "retromae.max_len": 64,
    "retromae.mask_pool_size": 16,
    "retromae.train.max_steps": 4,
    "retromae.train.batch_size": 4,
    "retromae.train.checkpoint_every": 2,
    "realm.retriever_dim": 16,
    "realm.query_len": 32,
    "realm.block_len": 52,
    "realm.top_k": 4,
    "realm.refresh_every": 2,
    "realm.ict_steps": 2,
    "realm.ict_batch_size": 4,
    "realm.reader_warmup_steps": 2,
    "realm.reader_warmup_batch_size": 4,
    "realm.staleness_probes": 8,
    "realm.train.max_steps": 4,
    "realm.train.batch_size": 2,
    "realm.train.checkpoint_every": 2,
    "finetune.train_sizes": ["all"],  # one finetune_retriever stage per start (test_eval_table runs a curve)
    "finetune.train.max_steps": 4,
    "finetune.train.batch_size": 4,
    "finetune.qa_train.max_steps": 2,
    "finetune.qa_train.batch_size": 2,
    "finetune.query_len": 24,
    "finetune.passage_len": 52,
    "evaluate.query_len": 24,
    "evaluate.passage_len": 52,
    "compute.device": "cpu",
}


def tiny_params(**overrides) -> Params:
    return load_params(ROOT / "params.yaml", overrides={**TINY, **overrides})


@pytest.fixture
def params() -> Params:
    return tiny_params()


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def dvc_stages(root: Path = ROOT) -> dict[str, dict]:
    """dvc.yaml's stages as DVC resolves them (`foreach` / `matrix` expanded into `<group>@<item>`,
    `${...}` filled in from params.yaml), in file order."""
    from dvc.dvcfile import load_file
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return load_file(repo, os.path.join(repo.root_dir, "dvc.yaml")).resolver.resolve()["stages"]


def make_workspace(dest: Path, overrides: dict | None = None) -> Path:
    """A throwaway copy of this repo (tracked + untracked-not-ignored files, and .dvc/), as a fresh
    git repo with tiny params: what a user's clone looks like, without touching this checkout."""
    import shutil
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    shutil.copytree(ROOT / ".dvc", dest / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"), dirs_exist_ok=True)
    from flows.set_params import apply_param_overrides

    apply_param_overrides({**TINY, **(overrides or {})}, path=str(dest / "params.yaml"))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", "commit", "-qm", "workspace"], cwd=dest, check=True, env=env)
    return dest


@pytest.fixture(scope="session")
def shared_prefect_api(tmp_path_factory):
    """One local Prefect API for the session, started the way `flows.pipeline` starts it."""
    from flows._runtime import local_prefect_api

    saved = os.environ.pop("PREFECT_API_URL", None)
    with local_prefect_api(home=tmp_path_factory.mktemp("prefect")) as url:
        yield url
    if saved:
        os.environ["PREFECT_API_URL"] = saved


def build_data_and_encoders(root: Path, p: Params, encoder_dirs: tuple[str, ...] = ("retromae/encoder",)) -> None:
    """`root/data/corpus` + `root/data/tokens` by the real stage functions, and one randomly
    initialised encoder (seed 0) saved as each `root/models/<dir>`: a stand-in for the upstream
    pre-training stages, for tests of the stages after them."""
    import torch

    from components.data.prepare import prepare_corpus
    from components.data.tokenize import load_tokenizer, tokenize_corpus
    from components.models.encoder import build_encoder, save_encoder

    prepare_corpus(p.data, root / paths.CORPUS)
    tokenize_corpus(p.tokenize, root / paths.CORPUS, root / paths.TOKENS)
    tok = load_tokenizer(root / paths.TOKENS / "tokenizer")
    torch.manual_seed(0)
    enc = build_encoder(p.retromae.encoder, len(tok), tok.pad_token_id, cls_token_id=tok.cls_token_id,
                        sep_token_id=tok.sep_token_id, mask_token_id=tok.mask_token_id)
    for name in encoder_dirs:
        save_encoder(enc, tok, root / paths.MODELS / name)


def overfit(model, batch, optimizer, steps: int = 25) -> list[float]:
    """Train `model` on one fixed batch; returns the loss of every step (for "loss falls" tests)."""
    losses = []
    for _ in range(steps):
        out = model(batch)
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
    return losses
