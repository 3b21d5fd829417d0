"""Results table (Markdown/HTML), plots and dvc-plots CSVs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from components.eval.report import recall_by_system, results_table, write_plots, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

ROWS = [
    {"system": "bm25", "dataset": "synthetic", "ndcg_at_10": 0.41, "mrr_at_10": 0.35,
     "recall_at_1": 0.3, "recall_at_5": 0.55, "recall_at_20": 0.7, "recall_at_100": 0.9, "per_query": {"q": {}}},
    {"system": "realm<retromae>", "dataset": "synthetic", "ndcg_at_10": 0.52, "mrr_at_10": 0.47,
     "recall_at_1": 0.4, "recall_at_5": 0.66, "recall_at_20": 0.8, "recall_at_100": 0.95, "em": 0.25, "f1": 0.31},
]


def test_markdown_table():
    md = results_table(ROWS)
    lines = md.strip().splitlines()
    assert lines[0] == "| System | Dataset | nDCG@10 | MRR@10 | R@1 | R@5 | R@20 | R@100 | EM | F1 |"
    assert len(lines) == 2 + len(ROWS)
    assert lines[2] == "| bm25 | synthetic | 0.410 | 0.350 | 0.300 | 0.550 | 0.700 | 0.900 | - | - |"
    # the best value per column is bold; EM has a single value, so nothing to compare: not bold
    assert "**0.520**" in lines[3] and "**0.950**" in lines[3] and "| 0.250 |" in lines[3]


def test_html_table_escapes():
    h = results_table(ROWS, fmt="html")
    assert h.count("<tr>") == 1 + len(ROWS)
    assert "realm&lt;retromae&gt;" in h and "<retromae>" not in h
    assert "<th>R@100</th>" in h
    with pytest.raises(ValueError):
        results_table(ROWS, fmt="latex")
    with pytest.raises(ValueError):
        results_table([])


def test_columns_follow_the_rows():
    md = results_table([{"system": "s", "dataset": "d", "recall_at_3": 0.5, "recall_at_1": 0.25}])
    assert md.splitlines()[0] == "| System | Dataset | R@1 | R@3 |"


def test_recall_by_system_labels():
    assert recall_by_system(ROWS)["bm25"] == {1: 0.3, 5: 0.55, 20: 0.7, 100: 0.9}
    two = ROWS + [{"system": "bm25", "dataset": "nq", "recall_at_1": 0.1}]
    assert set(recall_by_system(two)) == {"bm25 / synthetic", "realm<retromae> / synthetic", "bm25 / nq"}


def test_write_report_files(tmp_path: Path):
    curves = {"retromae loss": [(1, 7.0), (2, 6.5), (3, 6.1)], "mlm loss": [(1, 7.2), (2, 6.9)]}
    out = write_report(tmp_path / "eval", ROWS, curves=curves)
    assert set(out) == {"markdown", "html", "recall_csv", "recall_png", "curves_csv", "curves_png"}
    for key in ("recall_png", "curves_png"):
        data = out[key].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, key
    assert out["markdown"].read_text() == results_table(ROWS)
    assert out["html"].read_text().startswith("<!doctype html>")

    with open(out["recall_csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["system", "k", "recall"]  # long format for `dvc plots`
    assert len(rows) == 8 and rows[0] == {"system": "bm25", "k": "1", "recall": "0.3"}
    with open(out["curves_csv"], newline="") as f:
        crow = list(csv.DictReader(f))
    assert len(crow) == 5 and crow[-1] == {"name": "mlm loss", "step": "2", "value": "6.9"}
    assert not list((tmp_path / "eval").glob(".tmp-*"))  # atomic: no temp files left behind


def test_write_plots_only_what_is_given(tmp_path: Path):
    out = write_plots(tmp_path, curves={"loss": [(1, 1.0)], "empty": []})
    assert set(out) == {"curves_csv", "curves_png"}
    assert not (tmp_path / "recall_at_k.png").exists()
    assert write_plots(tmp_path / "none") == {}


def test_report_title_first_then_table_then_comparisons(tmp_path: Path):
    comps = [{"a": "realm<retromae>", "b": "bm25", "dataset": "synthetic", "metric": "recall_at_20",
              "delta": 0.1, "p_value": 0.0312, "n": 40, "question": "?"}]
    out = write_report(tmp_path / "eval", ROWS, title="evaluate.split: dev", comparisons=comps)
    md = out["markdown"].read_text()
    assert md.splitlines()[0] == "evaluate.split: dev"
    assert results_table(ROWS) in md
    assert md.rstrip().splitlines()[-1] == "| realm<retromae> | bm25 | synthetic | R@20 | +0.100 | 0.031 | 40 |"
    html = out["html"].read_text()
    assert "evaluate.split: dev" in html and "realm&lt;retromae&gt;" in html and "0.031" in html
    with open(out["comparisons_csv"], newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["p_value"] == "0.0312" and row["metric"] == "recall_at_20"
    assert "comparisons_csv" not in write_report(tmp_path / "plain", ROWS)  # none given, none written


def test_label_efficiency_csv_png_and_size_table(tmp_path: Path):
    """The curve's points -> label_efficiency.csv (long format, one row per point) and its PNG; the
    per-size tests -> one line per (set, size, B) with a delta (p) cell per metric, after the comparisons."""
    from components.eval.report import CURVE_COLUMNS, size_tests_table

    points = [{"dataset": "main", "start": s, "size": size, "questions": q, "kind": kind, "ndcg_at_10": v, "recall_at_20": v + 0.1}
              for s, kind in (("mlm", "fine-tuned"), ("retromae", "fine-tuned"), ("warm-start:mean", "reference"))
              for (size, q), v in zip((("32", 32), ("all", 480)), (0.2, 0.4))]
    tests = [{"dataset": "main", "size": "32", "questions": 32, "a": "ft:retromae@32", "b": "ft:mlm@32", "metric": m,
              "delta": 0.05, "p_value": 0.0123, "n": 100} for m in ("ndcg_at_10", "recall_at_20")]
    out = write_report(tmp_path / "eval", ROWS, label_efficiency=points, size_tests=tests)
    with open(out["curve_csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CURVE_COLUMNS and len(rows) == len(points)
    assert rows[-1] == {"dataset": "main", "start": "warm-start:mean", "size": "all", "questions": "480", "kind": "reference",
                        "ndcg_at_10": "0.4", "recall_at_20": "0.5"}
    assert out["curve_png"].read_bytes().startswith(PNG_MAGIC)
    line = "| main | 32 | 32 | ft:retromae@32 | ft:mlm@32 | +0.050 (0.012) | +0.050 (0.012) | 100 |"
    assert size_tests_table(tests).splitlines()[2] == line
    assert out["markdown"].read_text().rstrip().splitlines()[-1] == line
    assert "ft:retromae@32" in out["html"].read_text()
    assert "curve_csv" not in write_report(tmp_path / "plain", ROWS)  # no points, no curve
