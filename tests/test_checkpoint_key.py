"""A training stage resumes only a run of the same code, params, data and start (`checkpoint_dir`).

The bug this guards: a finished run's final checkpoint was keyed by params and data alone, so a
stage that DVC reran because its start encoder (an upstream model) or the code changed "resumed" at
its last step, trained nothing and wrote the stale model again. Where two stages do run the same
computation (a shared phase), the same key is what lets the second resume the first's result.
"""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from components import paths
from components.stages import common
from components.stages.common import checkpoint_dir, code_digest
from tests.conftest import TINY, build_data_and_encoders, make_workspace, tiny_params


def test_the_key_follows_the_start_folder_and_the_code(tmp_path, monkeypatch):
    p = tiny_params()
    start = tmp_path / "start"
    start.mkdir()
    (start / "weights.bin").write_bytes(b"a")
    key = lambda: checkpoint_dir("s", p, ["finetune"], tmp_path, inputs=[start])  # noqa: E731
    first = key()
    assert key() == first  # same code, params, data and start: resume
    (start / "weights.bin").write_bytes(b"b")
    second = key()
    assert second != first  # another start: a fresh folder
    monkeypatch.setattr(common, "code_digest", lambda: "edited")
    assert key() != second  # another code: a fresh folder
    assert checkpoint_dir("s", p, ["finetune"], tmp_path, inputs=[tmp_path / "absent"]) != first


def test_code_digest_reads_every_module_of_components_and_flows(tmp_path):
    for top in ("components", "flows"):
        shutil.copytree(common.REPO_ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_digest(tmp_path)
    assert before == code_digest()
    (tmp_path / "flows" / "evaluate.py").write_text((tmp_path / "flows" / "evaluate.py").read_text() + "\n# an edit\n")
    assert code_digest(tmp_path) != before


def test_a_rerun_after_the_start_encoder_changed_trains_instead_of_resuming(tmp_path, monkeypatch):
    """finetune_retriever@retromae-all twice: the second time from another retromae encoder. It must
    train again (no `resumed_from`) and write other weights."""
    from components.stages.finetune_retriever import finetune_retriever

    ws = make_workspace(tmp_path / "ws", {**TINY, "finetune.train.max_steps": 3, "finetune.retrieval_inits": ["retromae"]})
    params = tiny_params(**{"finetune.train.max_steps": 3, "finetune.retrieval_inits": ["retromae"]})
    build_data_and_encoders(ws, params, ("retromae/encoder",))
    monkeypatch.chdir(ws)
    out = paths.MODELS / "finetune" / "retriever" / "retromae-all"
    first = finetune_retriever(params, item="retromae-all")
    assert not first.get("resumed_from")
    weights = lambda: load_file(str(next(out.rglob("*.safetensors"))))  # noqa: E731
    trained = {k: v.clone() for k, v in weights().items()}

    again = finetune_retriever(params, item="retromae-all")  # nothing changed: the finished run resumes
    assert again["resumed_from"] == 3

    enc = paths.RETROMAE_ENCODER / "model.safetensors"
    state = load_file(str(enc))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, str(enc))  # pretrain_retromae reran
    third = finetune_retriever(params, item="retromae-all")
    assert not third.get("resumed_from"), third
    assert any(not torch.equal(trained[k], v) for k, v in weights().items())


def test_shared_phase_lets_one_stage_train_at_a_time(tmp_path):
    """Two stages entering the same shared phase (threads here: an flock is per open file, so two
    opens in one process exclude each other as two processes do): while the first is inside, the
    lock is taken and the second waits; it enters once the first has left."""
    import fcntl
    import os
    import threading
    import time

    import pytest

    from components.stages.common import shared_phase

    events: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with shared_phase(tmp_path / "phase", "a"):
            events.append("a in")
            inside.set()
            release.wait(30)
            events.append("a out")

    def second() -> None:
        with shared_phase(tmp_path / "phase", "b"):
            events.append("b in")

    a = threading.Thread(target=first, daemon=True)
    a.start()
    assert inside.wait(30)
    fd = os.open(tmp_path / "phase" / ".lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # the first holds the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    b = threading.Thread(target=second, daemon=True)
    b.start()
    time.sleep(1.0)
    assert events == ["a in"] and b.is_alive()  # the second is waiting, not inside
    release.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive()
    assert events == ["a in", "a out", "b in"]


def test_every_training_stages_key_follows_the_shared_trainer_group(tmp_path, monkeypatch):
    """The shared `trainer` group is filled into each stage's trainer block before the key is taken, so
    a change to it is a fresh folder for every training stage (an interrupted run never resumes under
    other optimiser settings), a per-stage override for the stages keyed by that section, and an
    override equal to the group's value for none."""
    from components.config import UNSET
    from components.stages import pretrain_realm
    from components.training.finetune import READER_SECTIONS, START_SECTIONS

    monkeypatch.setattr(common, "code_digest", lambda: "code")  # the same code throughout; hashing it is slow
    keys = {  # each stage's own sections, as its stage body passes them
        "pretrain_retromae": lambda p: checkpoint_dir("pretrain_retromae", p, ["retromae", "warm_start"], tmp_path),
        "pretrain_mlm": lambda p: checkpoint_dir("pretrain_mlm", p, ["retromae", "mlm", "warm_start"], tmp_path),
        "pretrain_realm": lambda p: pretrain_realm.checkpoint_root(p, corpus_dir=tmp_path),
        "pretrain_realm_warmup": lambda p: pretrain_realm.warmup_root(p, corpus_dir=tmp_path),
        "finetune_retriever": lambda p: checkpoint_dir("ft", p, ["finetune", "warm_start", *START_SECTIONS["init"]], tmp_path),
        "finetune_reader": lambda p: checkpoint_dir("qa", p, READER_SECTIONS, tmp_path),
    }

    def changed(**overrides) -> set[str]:
        base, other = tiny_params(), tiny_params(**overrides)
        return {stage for stage, key in keys.items() if key(base) != key(other)}

    assert changed(**{"trainer.max_grad_norm": 0.5}) == set(keys)
    assert changed(**{"trainer.keep_checkpoints": 3}) == set(keys)
    # REALM's override: its stages and the readers (keyed by realm, as they read its index and arms)
    assert changed(**{"realm.train.max_grad_norm": 0.5}) == {"pretrain_realm", "pretrain_realm_warmup", "finetune_reader"}
    assert changed(**{"realm.train.max_grad_norm": 1.0}) == set()  # = the group's value: the same folder
    # a group change every block overrides back to today's value changes nothing that trains
    every = {f"{b}.max_grad_norm": 1.0 for b in ("retromae.train", "realm.train", "finetune.train", "finetune.qa_train")}
    assert changed(**{"trainer.max_grad_norm": 0.5, **every}) == set()
    assert changed(**{"retromae.train.max_grad_norm": UNSET}) == set()  # not set there: nothing to remove
