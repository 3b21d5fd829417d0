"""One stage per question (issue 31): a param change dirties the stages that read it and no other,
checked with DVC's own `dvc status` on a workspace whose dvc.lock was recorded over stand-in outputs
(`dvc commit`, as tests/test_dvc_inputs.py does), so nothing trains.

- a param only RetroMAE reads (`retromae.decoder_mask_ratio`) names `pretrain_retromae`; once it has
  rerun (its encoder changed, the init encoder it also writes did not), the stages that read
  models/retromae follow, and `pretrain_mlm`, `finetune_retriever@init-*` and `@mlm-*` never do;
- a reader param names only the reader stages (and evaluate, when evaluate reads it too);
- a retriever fine-tuning param names only the finetune_retriever stages;
- a key of the shared `trainer` group names every training stage; the same key overridden in one
  stage's trainer block (`dvc exp run -S +<block>.KEY=V`, as DVC spells a key the file does not hold)
  names that stage's group only, and removing the override (`-S ~<block>.KEY`) makes it clean again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import UNSET
from flows.set_params import apply_param_overrides
from tests.test_dvc_inputs import _dvc, _locked_workspace, _stale

SIZES = [8, "all"]
STARTS = ("init", "mlm", "retromae", "realm")
READERS = {"finetune_reader@bm25", "finetune_reader@realm", "finetune_reader@realm-stale"}
RETRIEVERS = {f"finetune_retriever@{s}-{n}" for s in STARTS for n in SIZES}
REALM = {"pretrain_realm@refreshed", "pretrain_realm@stale"}
TRAINING = {"pretrain_retromae", "pretrain_mlm", *REALM, *RETRIEVERS, *READERS}


@pytest.fixture(scope="module")
def locked(tmp_path_factory) -> Path:
    return _locked_workspace(tmp_path_factory.mktemp("invalidation"), {"finetune.train_sizes": SIZES})


@pytest.fixture
def ws(locked) -> Path:
    """The locked workspace, its params.yaml as committed (the lock is clean again)."""
    subprocess.run(["git", "checkout", "params.yaml"], cwd=locked, check=True)
    return locked


def _set(ws: Path, **overrides) -> None:
    apply_param_overrides({k.replace("__", "."): v for k, v in overrides.items()}, path=str(ws / "params.yaml"))


@pytest.mark.parametrize("key, value, evaluate_reads_it", [
    ("finetune.qa_train.lr", 0.0004, False),
    ("finetune.qa_gold_steps", 3, False),
    ("finetune.max_answer_tokens", 8, True),   # evaluate decodes spans with the trained length
])
def test_a_reader_param_dirties_the_readers_only(ws, key, value, evaluate_reads_it):
    assert _stale(ws) == set()
    apply_param_overrides({key: value}, path=str(ws / "params.yaml"))
    assert _stale(ws) == READERS | ({"evaluate"} if evaluate_reads_it else set())


def test_a_new_training_size_adds_its_stages_and_reruns_no_other_fine_tune(ws):
    _set(ws, finetune__train_sizes=[8, 16, "all"])
    assert _stale(ws) == {*(f"finetune_retriever@{s}-16" for s in STARTS), "evaluate"}  # evaluate: the table gains rows


def test_a_retriever_param_dirties_the_retriever_fine_tunes_only(ws):
    _set(ws, finetune__train__lr=0.0009)
    assert _stale(ws) == RETRIEVERS


def test_a_shared_trainer_key_dirties_every_training_stage_and_no_other(ws):
    _set(ws, trainer__weight_decay=0.02)
    assert _stale(ws) == TRAINING


@pytest.mark.parametrize("key, stages", [
    ("retromae.train.weight_decay", {"pretrain_retromae", "pretrain_mlm"}),  # MLM trains with retromae.train
    ("realm.train.weight_decay", REALM),
    ("finetune.train.weight_decay", RETRIEVERS),
    ("finetune.qa_train.weight_decay", READERS),
])
def test_a_per_stage_override_of_a_shared_key_dirties_that_stage_only(ws, key, stages):
    apply_param_overrides({key: 0.02}, path=str(ws / "params.yaml"))  # a key the block did not hold: `-S +key=0.02`
    assert _stale(ws) == stages
    apply_param_overrides({key: UNSET}, path=str(ws / "params.yaml"))  # `-S ~key`: the group's value again
    assert _stale(ws) == set()


def test_dvc_exp_run_sets_the_group_and_appends_an_override(ws):
    """The shell form itself: `dvc exp run -S` refuses to set a key the block does not hold (with
    Hydra's hint to append it), appends it with `+`, and `dvc params diff` names it."""
    def exp_run(*sets: str) -> subprocess.CompletedProcess:
        args = [a for kv in sets for a in ("-S", kv)]
        return subprocess.run([sys.executable, "-m", "dvc", "exp", "run", *args, "source_digest"], cwd=ws,
                              capture_output=True, text=True, timeout=600)

    def diff() -> dict[str, tuple]:
        changed = json.loads(_dvc(ws, "params", "diff", "--json"))["params.yaml"]
        return {k: (v["old"], v["new"]) for k, v in changed.items()}

    refused = exp_run("retromae.train.weight_decay=0.02")
    assert refused.returncode != 0 and "+retromae.train.weight_decay=0.02" in refused.stdout + refused.stderr
    assert _stale(ws) == set()  # nothing written
    assert exp_run("+retromae.train.weight_decay=0.02").returncode == 0
    assert _stale(ws) == {"pretrain_retromae", "pretrain_mlm"}
    assert diff() == {"retromae.train.weight_decay": (None, 0.02)}
    subprocess.run(["git", "checkout", "params.yaml"], cwd=ws, check=True)
    assert exp_run("trainer.weight_decay=0.02").returncode == 0
    assert _stale(ws) == TRAINING
    assert diff() == {"trainer.weight_decay": (0.01, 0.02)}


def test_a_retromae_param_dirties_the_retromae_chain_only(ws):
    """Last in this module: it commits a new lock for pretrain_retromae."""
    _set(ws, retromae__decoder_mask_ratio=0.4)
    assert _stale(ws) == {"pretrain_retromae"}  # not pretrain_mlm: it reads retromae.encoder/max_len/train only
    # pretrain_retromae reruns: its encoder changes; the init encoder (models/init) is the same start
    (ws / "models/retromae/stand_in.txt").write_text("retrained with decoder_mask_ratio 0.4")
    _dvc(ws, "commit", "--force", "pretrain_retromae")
    after = _stale(ws)
    assert after == {"pretrain_realm@refreshed", "pretrain_realm@stale", *(f"finetune_retriever@retromae-{n}" for n in SIZES),
                     *READERS, "evaluate"}
    assert not after & {"pretrain_mlm", *(f"finetune_retriever@{s}-{n}" for s in ("init", "mlm") for n in SIZES)}
