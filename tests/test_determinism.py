"""Determinism on CPU.

* prepare_corpus and pretrain_retromae: two runs in separate processes with the same seed give
  byte-identical corpus files, identical per-step metrics, checkpoints and encoder weights. The two
  processes get different PYTHONHASHSEEDs, so anything that iterates a set or dict of strings in
  hash order would show up.
* tokenize: NOT deterministic. The `tokenizers` WordPiece trainer breaks ties between equally
  frequent merges by token ids that it hands out in hash-map order (Rust, per process and even per
  call): huggingface/tokenizers#1794, fix proposed in huggingface/tokenizers#2066. The tokenizer in
  `data/tokens/` (a DVC output, cached and pushed) is therefore the reproducibility anchor: the
  stages after it are deterministic given it. The xfail below is not strict: four trainings can
  agree by chance, so an XPASS is luck, not a fix.

What is and is not deterministic on GPU: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_workspace

_STAGES = r"""
import json
from components.config import load_params
from components.data.prepare import prepare_corpus
from components.stages.pretrain_retromae import train_encoder

class Recorder:
    rows = []
    def log_metrics(self, metrics, step):
        self.rows.append({"step": step, **metrics})

p = load_params("params.yaml")
card = prepare_corpus(p.data, "data/corpus")     # rewritten in this process (tokens come from the shared run)
rec = Recorder()
summary = train_encoder("pretrain_retromae", p, rec)
json.dump({"card": card, "summary": summary, "metrics": rec.rows}, open("result.json", "w"))
"""

# Wall-clock numbers are the only things allowed to differ between two runs.
# readings of the machine, not results of the seed: wall times, rates and host memory
TIMING = {"samples_per_s", "tokens_per_s", "train_seconds", "seconds", "throughput", "created", "created_unix",
          "rss_mb", "peak_rss_mb"}


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMING and k.removeprefix("final_") not in TIMING}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _tensors_digest(path: Path) -> str:
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(path).items()):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file, except: meta.json (a creation time, and the checkpoint's file hashes)
    by its content minus those; a checkpoint's model.safetensors by its tensors, because a
    safetensors header with several metadata keys (the tied-weight map) is written in Rust
    hash-map order, so its bytes differ from run to run while every tensor is identical."""
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        if p.name == "meta.json":
            meta = _strip(json.loads(p.read_text()))
            meta.get("files", {}).pop("model.safetensors", None)
            out[rel] = json.dumps(meta, sort_keys=True)
        elif p.suffix == ".safetensors" and "checkpoints" in p.parts:
            out[rel] = _tensors_digest(p)
        elif p.name != "model_card.md":  # the model card prints tokens/s
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.slow  # reason: one tiny data build plus two stage processes, ~30-60 s on 2 cores
def test_two_runs_with_the_same_seed_are_identical(tmp_path):
    from components.config import load_params
    from components.data.prepare import prepare_corpus
    from components.data.tokenize import tokenize_corpus

    base = make_workspace(tmp_path / "base", {"retromae.train.max_steps": 6, "retromae.train.checkpoint_every": 3})
    p = load_params(base / "params.yaml")
    prepare_corpus(p.data, base / "data" / "corpus")
    tokenize_corpus(p.tokenize, base / "data" / "corpus", base / "data" / "tokens")

    runs = []
    for name, hash_seed in (("a", "1"), ("b", "2")):
        ws = tmp_path / name
        shutil.copytree(base, ws, symlinks=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ws), "PYTHONHASHSEED": hash_seed}
        env.pop("RR_CHECKPOINT_ROOT", None)
        runs.append((ws, subprocess.Popen([sys.executable, "-c", _STAGES], cwd=ws, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    for ws, proc in runs:  # both at once: the 2 cores are shared, as on a busy CI box
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-3000:]

    (a, _), (b, _) = runs
    ra, rb = (json.loads((ws / "result.json").read_text()) for ws in (a, b))
    assert _strip(ra["card"]) == _strip(rb["card"])
    assert _file_digests(a / "data/corpus") == _file_digests(b / "data/corpus") == _file_digests(base / "data/corpus")
    assert [m["step"] for m in ra["metrics"]] == list(range(1, 7))
    assert _strip(ra["metrics"]) == _strip(rb["metrics"])  # every logged number, every step, exactly
    assert _strip(ra["summary"]) == _strip(rb["summary"])
    for folder in ("models/retromae", "checkpoints"):
        da, db = _file_digests(a / folder), _file_digests(b / folder)
        assert da.keys() == db.keys() and da, folder
        assert not sorted(k for k in da if da[k] != db[k]), folder  # weights, optimizer state, RNG states
    # the published encoder (HF save_pretrained: one metadata key) is identical byte for byte
    enc = "models/retromae/encoder/model.safetensors"
    assert hashlib.sha256((a / enc).read_bytes()).digest() == hashlib.sha256((b / enc).read_bytes()).digest()


@pytest.mark.xfail(strict=False, reason="huggingface/tokenizers#1794: WordPiece training breaks merge ties in hash-map "
                                        "order, so four trainings may also agree by chance (non-strict: an XPASS is luck, not a fix); "
                                        "remove this marker (and update docs/reliability.md) once a fixed tokenizers is locked")
def test_tokenizer_training_is_deterministic():
    from components.config_stages import SplitParams, SyntheticParams
    from components.data.synthetic import generate_world
    from components.data.tokenize import train_wordpiece

    texts = [p["text"] for p in generate_world(SyntheticParams(num_entities=24, distractor_docs=8), SplitParams()).passages]
    vocabs = {json.dumps(train_wordpiece(texts, 400, True, 1).get_vocab(), sort_keys=True) for _ in range(4)}
    assert len(vocabs) == 1
