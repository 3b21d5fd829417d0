"""What runs is what DVC sees: a preset is written into params.yaml (so `dvc status` lists exactly
the stages whose values change), `dvc exp run -S` keeps params.yaml's comments, and the content
behind `data.path` (a local file, an S3 object) is a dependency of prepare_corpus.

The fast tests record a dvc.lock over stand-in outputs (`dvc commit`), so `dvc status` compares
params and deps without training anything; the slow ones run the real stages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.config import UNSET
from flows.set_params import _leaves, apply_param_overrides, preset_overrides, preset_switch, set_params_args
from tests.conftest import ROOT, dvc_stages, make_workspace

ALWAYS = "source_digest"  # always_changed: it re-reads the source on every status / repro


def _dvc(ws: Path, *args: str, env: dict | None = None) -> str:
    venv_bin = str(Path(sys.executable).parent)
    env = {**(env or os.environ), "PATH": venv_bin + os.pathsep + os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"dvc {' '.join(args)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _stale(ws: Path, env: dict | None = None) -> set[str]:
    return set(json.loads(_dvc(ws, "status", "--json", env=env) or "{}")) - {ALWAYS}


def _stand_in_outputs(ws: Path) -> None:
    """A file or folder at every out / metrics / plots path of dvc.yaml, then dvc.lock over them."""
    spec = dvc_stages(ws)
    for name, st in spec.items():
        if name == ALWAYS:
            continue
        for key in ("outs", "metrics", "plots"):
            for entry in st.get(key, []):
                path = ws / (next(iter(entry)) if isinstance(entry, dict) else entry)
                if path.suffix:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("{}\n" if path.suffix == ".json" else "step,value\n0,0\n")
                else:
                    path.mkdir(parents=True, exist_ok=True)
                    (path / "stand_in.txt").write_text(name)


def _locked_workspace(tmp_path: Path, overrides: dict | None = None, env: dict | None = None) -> Path:
    ws = make_workspace(tmp_path / "ws", overrides)
    _stand_in_outputs(ws)
    _dvc(ws, "repro", ALWAYS, env=env)  # the digest of the source, as a real run computes it first
    _dvc(ws, "commit", "--force", env=env)
    assert _stale(ws, env) == set()
    return ws


def _declared(spec: dict) -> dict[str, list[str]]:
    return {name: [next(iter(p)) if isinstance(p, dict) else p for p in st.get("params", [])] for name, st in spec.items()}


def _get(raw: dict, dotted: str):
    for k in dotted.split("."):
        raw = raw.get(k) if isinstance(raw, dict) else None
    return raw


_ALL_FT = {"finetune_retriever", "finetune_reader"}


def _groups(stages: set[str]) -> set[str]:
    return {s.partition("@")[0] for s in stages}


@pytest.mark.parametrize("preset, expected", [
    ("paper", {"tokenize", "pretrain_retromae", "pretrain_mlm", "pretrain_realm", *_ALL_FT, "evaluate"}),
    # small names no data, tokenize, warm-start or RetroMAE key (it shares the default's corpus and its
    # RetroMAE / MLM recipe), so over tiny's world everything before REALM stays clean
    ("small", {"pretrain_realm", *_ALL_FT, "evaluate"}),
])
def test_a_preset_switch_dirties_exactly_the_stages_whose_values_change(tmp_path, preset, expected):
    # The preset's keys over tiny's world (not `--preset`'s switch, which also resets tiny's own keys):
    # tiny's ICT stays on, so its batch must split under small's realm.train.grad_accum (8) too.
    ws = _locked_workspace(tmp_path, {"realm.ict_batch_size": 8})
    before = yaml.safe_load((ws / "params.yaml").read_text())
    apply_param_overrides(preset_overrides(str(ws / "params" / f"{preset}.yaml")), path=str(ws / "params.yaml"))
    after = yaml.safe_load((ws / "params.yaml").read_text())
    spec = dvc_stages(ws)
    changed = {s for s, keys in _declared(spec).items() if any(_get(before, k) != _get(after, k) for k in keys)}
    assert _groups(changed) == expected  # the oracle: which declared values the preset changes
    assert _stale(ws) == changed
    # switching back (git checkout of params.yaml) makes every stage clean again
    subprocess.run(["git", "checkout", "params.yaml"], cwd=ws, check=True)
    assert _stale(ws) == set()


def test_set_param_keeps_every_comment_and_changes_only_the_lines_it_sets(tmp_path):
    """The same code as `dvc exp run -S` (DVC's apply_overrides); the slow test runs the CLI itself."""
    f = tmp_path / "params.yaml"
    f.write_text((ROOT / "params.yaml").read_text())
    before = f.read_text().splitlines()
    apply_param_overrides({"retromae.train.max_steps": 61, "realm.top_k": 7}, path=str(f))
    after = f.read_text().splitlines()
    assert len(after) == len(before)
    diff = [(a, b) for a, b in zip(before, after) if a != b]
    assert [b.split("#")[0].strip() for _, b in diff] == ["max_steps: 61", "top_k: 7"], diff
    assert [l.partition("#")[2] for l in after if "#" in l] == [l.partition("#")[2] for l in before if "#" in l]  # every comment kept


def test_set_params_args_are_what_dvc_exp_run_takes():
    assert set_params_args({"a.b": 1, "c": None, "d": "package:x/y", "e": [1, "z"], "f": True, "g": 3e-05}) == [
        "a.b=1", "c=null", "d='package:x/y'", "e=[1,'z']", "f=true", "g=3e-05"]
    # a key the file does not hold is appended (DVC refuses `-S key=value` for it); UNSET removes one
    assert set_params_args({"a.b": 1, "a.c": 2, "a.d": UNSET}, current={"a": {"b": 0, "d": 1}}) == ["a.b=1", "+a.c=2", "~a.d"]


def test_every_stage_that_reads_a_trainer_block_declares_the_shared_group():
    """`trainer` fills every trainer block, so a stage that declares one (or the section holding it)
    must declare `trainer` too, or `dvc exp run -S trainer.KEY=...` would leave it cached."""
    from components.config_file import TRAIN_BLOCKS

    declared = _declared(dvc_stages())
    reads = {s for s, keys in declared.items() if any(b == k or b.startswith(k + ".") for b in TRAIN_BLOCKS for k in keys)}
    assert _groups(reads) == {"pretrain_retromae", "pretrain_mlm", "pretrain_realm", *_ALL_FT}
    assert {s for s, keys in declared.items() if "trainer" in keys} == reads


def test_a_per_stage_override_is_appended_to_its_block_and_unset_removes_it(tmp_path):
    """Overriding a shared key in one block writes the line DVC's `-S +key=value` writes; UNSET (`-S ~key`)
    takes it out again, leaving the file as it was. Comments stay either way."""
    from components.config import load_params

    f = tmp_path / "params.yaml"
    f.write_text((ROOT / "params.yaml").read_text())
    before = f.read_text()
    assert apply_param_overrides({"realm.train.weight_decay": 0.0, "trainer.max_grad_norm": 0.5}, path=str(f))
    after = f.read_text().splitlines()
    added = [l for l in after if l not in before.splitlines()]
    assert [l.split("#")[0].rstrip() for l in added] == ["  max_grad_norm: 0.5", "    weight_decay: 0.0"], added
    assert after.index("    weight_decay: 0.0") > after.index("realm:")  # in REALM's block
    p = load_params(f)
    assert (p.realm.train.weight_decay, p.retromae.train.weight_decay, p.finetune.qa_train.max_grad_norm) == (0.0, 0.01, 0.5)
    assert [l.partition("#")[2] for l in after if "#" in l] == [l.partition("#")[2] for l in before.splitlines() if "#" in l]
    assert apply_param_overrides({"realm.train.weight_decay": UNSET, "trainer.max_grad_norm": 1.0}, path=str(f))
    assert f.read_text() == before
    assert not apply_param_overrides({"realm.train.weight_decay": UNSET}, path=str(f))  # nothing to remove
    # the wrapper's --set takes DVC's spelling too
    from components.config_file import parse_overrides

    assert parse_overrides(["+realm.train.weight_decay=0.0", "++trainer.num_workers=1", "realm.top_k=3"]) == {
        "realm.train.weight_decay": 0.0, "trainer.num_workers": 1, "realm.top_k": 3}
    # and its numbers: 5e-5 is a float there (PyYAML alone reads the string '5e-5'); other strings stay strings
    assert parse_overrides(["realm.ict_lr=5e-5", "realm.train.lr=-1E+3", "a.b=.5e2", "x.y=1e", "x.z=e5", "q.r=null"]) == {
        "realm.ict_lr": 5e-5, "realm.train.lr": -1000.0, "a.b": 50.0, "x.y": "1e", "x.z": "e5", "q.r": None}


def test_a_local_corpus_edit_dirties_prepare_corpus(tmp_path):
    corpus = tmp_path / "ws" / "corpus" / "c.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text('{"id": "a", "text": "first passage"}\n')
    ws = _locked_workspace(tmp_path, {"data.source": "jsonl", "data.path": "corpus/c.jsonl"})
    _dvc(ws, "repro", ALWAYS)
    assert _stale(ws) == set()  # same content: the digest file keeps its bytes
    corpus.write_text('{"id": "a", "text": "first passage, edited"}\n')
    _dvc(ws, "repro", ALWAYS)
    assert _stale(ws) == {"prepare_corpus"}


@pytest.mark.servers
def test_an_s3_object_change_dirties_prepare_corpus(tmp_path, s3_server):
    bucket = s3_server.buckets["data"]
    s3 = s3_server.client()
    s3.put_object(Bucket=bucket, Key="rr-digest/c.jsonl", Body=b'{"id": "a", "text": "first passage"}\n')
    env = {**os.environ, **s3_server.env}
    ws = _locked_workspace(tmp_path, {"data.source": "s3", "data.path": f"s3://{bucket}/rr-digest/"}, env=env)
    card = json.loads((ws / "data/source.json").read_text())
    assert card["files"] == 1 and card["kind"].startswith("s3")
    s3.put_object(Bucket=bucket, Key="rr-digest/c.jsonl", Body=b'{"id": "a", "text": "changed on S3"}\n')
    _dvc(ws, "repro", ALWAYS, env=env)
    assert _stale(ws, env) == {"prepare_corpus"}


@pytest.mark.slow
def test_dvc_exp_run_set_param_keeps_comments_and_the_lock_holds_what_ran(tmp_path, shared_prefect_api):
    ws = make_workspace(tmp_path / "ws")
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api, "MLFLOW_TRACKING_URI": f"sqlite:///{ws}/mlflow.db",
           "RR_PARENT_RUN_ID": ""}
    before = (ws / "params.yaml").read_text().splitlines()
    _dvc(ws, "exp", "run", "-S", "tokenize.vocab_size=420", "tokenize", env=env)
    after = (ws / "params.yaml").read_text().splitlines()
    assert [l for l in after if "#" in l] == [l for l in before if "#" in l]
    assert [(a, b) for a, b in zip(before, after) if a != b] == [("  vocab_size: 400", "  vocab_size: 420")]
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]
    assert lock["tokenize"]["params"]["params.yaml"]["tokenize"]["vocab_size"] == 420
    # what ran is up to date; only the stages downstream of tokenize, never run here, are stale
    assert "prepare_corpus" in lock and not _stale(ws, env) & {"prepare_corpus", "tokenize"}


def test_presets_switch_from_the_committed_default_instead_of_stacking(tmp_path, monkeypatch):
    """`--preset tiny` then `--preset small` is small (not small's few keys over tiny's world), and
    `--preset default` returns to params.yaml as committed, user keys no preset names untouched."""
    import shutil

    from components.config import load_params

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "params", tmp_path / "params")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "default"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, env=env)
    monkeypatch.chdir(tmp_path)

    def dump(**kw):
        return load_params(tmp_path / "params.yaml", **kw).model_dump()

    apply_param_overrides({"tracking.experiment": "mine"}, path="params.yaml")  # a user's own edit
    for preset in ("tiny", "small", "paper", "small"):
        apply_param_overrides(preset_switch(preset), path="params.yaml")
        want = load_params(ROOT / "params.yaml", presets=[ROOT / "params" / f"{preset}.yaml"],
                           overrides={"tracking.experiment": "mine"}).model_dump()
        assert dump() == want, preset
        # paper pins RetroMAE's warm-up ratio in its block; the next switch removes that override, so the
        # block follows `trainer` again instead of keeping a stale copy of the value
        raw = yaml.safe_load(Path("params.yaml").read_text())
        assert ("warmup_ratio" in raw["retromae"]["train"]) == (preset == "paper"), preset
    apply_param_overrides(preset_switch("default"), path="params.yaml")
    assert dump() == load_params(ROOT / "params.yaml", overrides={"tracking.experiment": "mine"}).model_dump()
    # and holds the committed keys, no more (the values are the dump's above; DVC writes floats as 3e-05)
    keys = lambda path: set(_leaves(yaml.safe_load(Path(path).read_text())))  # noqa: E731
    assert keys("params.yaml") == keys(ROOT / "params.yaml")
