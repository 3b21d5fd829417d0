"""`dvc metrics show` prints the headline numbers in a table a person reads (<= 120 columns), and
`dvc plots show` has a definition for each curve (one line per system for recall@k)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from components import paths
from components.config_stages import REALM_ARMS
from components.eval.headline import write_headline
from tests.conftest import ROOT

SYSTEMS = ["bm25", "warm-start:mean", "init", "retromae", "mlm", "realm", "realm-stale",
           "ft:init", "ft:mlm", "ft:retromae", "ft:realm"]
QA = ["qa:closed-book", "qa:bm25", "qa:realm", "qa:realm-stale"]


def _table() -> dict:
    row = {"ndcg_at_10": 0.41234, "mrr_at_10": 0.3, "recall_at_1": 0.2, "recall_at_5": 0.5, "recall_at_20": 0.7,
           "recall_at_100": 0.93456, "n_queries": 52, "seconds": 1.5}
    return {"main": {**{s: dict(row) for s in SYSTEMS}, **{q: {"em": 0.1234, "f1": 0.2, "n": 52} for q in QA}}}


def _dvc(ws: Path, *args: str) -> str:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]}
    out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_headline_has_one_small_file_per_system_and_training_figures(tmp_path):
    (tmp_path / "pretrain_realm.json").write_text(json.dumps(
        {"final_loss": 3.21987, "heldout_entity_recall_at_k": 0.505, "mean_staleness": 0.8123, "step": 200}))
    (tmp_path / "pretrain_retromae.json").write_text(json.dumps({"final_loss": 9.87654, "step": 60}))
    written = write_headline(tmp_path / "headline", _table(), [1, 5, 20, 100], tmp_path)
    rows = {f.stem: json.loads(f.read_text()) for f in written}
    assert rows["bm25"] == {"main": {"nDCG@10": 0.412, "R@100": 0.935}}
    assert rows["qa_realm"] == {"main": {"EM": 0.123}}
    assert rows["pretrain_realm"] == {"loss": 3.22, "recall": 0.505, "stale": 0.812}
    assert rows["pretrain_retromae"] == {"loss": 9.877}
    # rewritten afresh: a system gone from the table leaves no stale row
    write_headline(tmp_path / "headline", {"main": {"bm25": _table()["main"]["bm25"]}}, [1, 5], tmp_path)
    assert sorted(f.stem for f in (tmp_path / "headline").iterdir()) == ["bm25", "pretrain_realm", "pretrain_retromae"]
    assert json.loads((tmp_path / "headline/bm25.json").read_text()) == {"main": {"nDCG@10": 0.412, "R@5": 0.5}}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]  # swapped in whole, nothing left over


def test_dvc_metrics_show_fits_120_columns(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    _dvc(tmp_path, "init", "-q")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/pretrain_realm.json").write_text(json.dumps(
        {"final_loss": 3.2, "heldout_entity_recall_at_k": 0.5, "mean_staleness": 0.8}))
    for s in ("pretrain_retromae", "pretrain_mlm"):
        (tmp_path / f"metrics/{s}.json").write_text(json.dumps({"final_loss": 9.87654}))
    write_headline(tmp_path / "metrics/headline", _table(), [1, 5, 20, 100], tmp_path / "metrics")
    # the metrics dvc.yaml declares, and nothing else
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    declared = [next(iter(m)) if isinstance(m, dict) else m for st in spec.values() for m in st.get("metrics", [])]
    assert declared == ["metrics/headline"]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"metrics": declared}))
    out = _dvc(tmp_path, "metrics", "show")
    lines = out.splitlines()
    assert len(lines) == 1 + len(SYSTEMS) + len(QA) + 3, out
    assert max(len(line) for line in lines) <= 120, out
    assert "main.nDCG@10" in lines[0] and "main.EM" in lines[0]


def test_plots_have_a_definition_for_each_curve():
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    plots = {next(iter(p)) if isinstance(p, dict) else p: (p[next(iter(p))] if isinstance(p, dict) else {}) for p in spec["plots"]}
    recall = plots["recall_at_k"]
    template = json.loads((ROOT / recall["template"]).read_text())
    assert template["encoding"]["color"]["field"] == "system"  # one line per system, not one zig-zag
    assert recall["y"] == {"plots/recall_at_k.csv": "recall"}
    assert set(plots["realm_refresh"]["y"]["plots/realm_refresh.csv"]) >= {"heldout_recall_at_k", "staleness"}
    assert {"metrics/eval/recall_at_k.png", "metrics/eval/training_curves.png"} <= set(plots)  # images: no JS
    stages = ["pretrain_retromae", "pretrain_mlm", *(f"pretrain_realm@{arm}" for arm in REALM_ARMS)]
    assert plots["training_loss"]["y"] == {str(paths.loss_curve(s)): "loss" for s in stages}
    # a plots file is declared once, as a stage's output, and drawn only by the top-level definitions
    assert not any(st.get("plots") for st in spec["stages"].values())


def test_the_offline_page_template_loads_nothing_from_a_cdn():
    import pytest

    page = ROOT / "plots/templates/offline.html"
    if not page.is_file():
        pytest.skip("plots/templates/offline.html is built by scripts/vega_offline.sh (needs npm once)")
    html = page.read_text()
    assert "{plot_divs}" in html and "{scripts}" not in html and "<script src" not in html
    assert "vegaEmbed" in html and html.count("<script>") == 3
