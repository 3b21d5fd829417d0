"""The results table (Markdown + HTML), recall@k and training-curve plots, and CSVs for `dvc plots`.

    from components.eval.report import write_report
    rows = [{"system": "bm25", "dataset": "synthetic", **retrieval_metrics(qrels, run)}, ...]
    write_report("reports/eval", rows, curves={"retromae loss": [(1, 7.1), (2, 6.8)], ...},
                 title="split: test", comparisons=[{"a", "b", "dataset", "metric", "delta", "p_value", "n"}, ...])

A row is a dict with `system`, `dataset` and any of the metric keys `metrics.py` produces
(`ndcg_at_10`, `mrr_at_10`, `recall_at_{k}`, `em`, `f1`); missing metrics print as "-", extra
keys (e.g. `per_query`) are ignored. Values are fractions in [0, 1]; the best value of each
column within a dataset is bold. Every file is written atomically (temp sibling + os.replace),
and plots are drawn on an Agg canvas without pyplot, so no global backend state is touched.

    dvc plots show reports/eval/recall_at_k.csv -x k -y recall     # long format: system,k,recall
"""

from __future__ import annotations

import csv
import html
import io
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

from components.io import write_bytes_atomic, write_text_atomic

_RECALL = re.compile(r"^recall_at_(\d+)$")


def _columns(rows: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(row key, header) for every metric some row has, in table order."""
    ks = sorted({int(m.group(1)) for r in rows for key in r if (m := _RECALL.match(key))})
    cols = [("ndcg_at_10", "nDCG@10"), ("mrr_at_10", "MRR@10")]
    cols += [(f"recall_at_{k}", f"R@{k}") for k in ks]
    cols += [("em", "EM"), ("f1", "F1")]
    return [(key, head) for key, head in cols if any(r.get(key) is not None for r in rows)]


def _cells(rows: Sequence[Mapping], digits: int) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Header and body as (text, is_best) cells."""
    cols = _columns(rows)
    best: dict[tuple[str, str], float] = {}
    count: dict[tuple[str, str], int] = {}
    for r in rows:
        for key, _ in cols:
            if r.get(key) is not None:
                cell = (str(r.get("dataset", "")), key)
                best[cell] = max(best.get(cell, float("-inf")), float(r[key]))
                count[cell] = count.get(cell, 0) + 1
    header = ["System", "Dataset"] + [head for _, head in cols]
    body = []
    for r in rows:
        ds = str(r.get("dataset", ""))
        line = [(str(r.get("system", "?")), False), (ds, False)]
        for key, _ in cols:
            v = r.get(key)
            if v is None:
                line.append(("-", False))
            else:
                # bold the best, only where the column has something to compare against
                line.append((f"{float(v):.{digits}f}", count[(ds, key)] > 1 and float(v) == best[(ds, key)]))
        body.append(line)
    return header, body


def results_table(rows: Sequence[Mapping], fmt: str = "markdown", digits: int = 3) -> str:
    """The results table as Markdown (`fmt="markdown"`) or an HTML fragment (`fmt="html"`)."""
    if not rows:
        raise ValueError("results_table: no rows")
    header, body = _cells(rows, digits)
    if fmt == "markdown":
        def md(text: str) -> str:
            return text.replace("|", "\\|")

        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join(["---", "---"] + ["---:"] * (len(header) - 2)) + "|"]
        lines += ["| " + " | ".join(f"**{md(t)}**" if b else md(t) for t, b in line) + " |" for line in body]
        return "\n".join(lines) + "\n"
    if fmt == "html":
        th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        trs = "".join(
            "<tr>" + "".join(f"<td>{'<b>' if b else ''}{html.escape(t)}{'</b>' if b else ''}</td>" for t, b in line) + "</tr>\n"
            for line in body)
        return f'<table class="results">\n<thead><tr>{th}</tr></thead>\n<tbody>\n{trs}</tbody>\n</table>\n'
    raise ValueError(f"fmt must be 'markdown' or 'html', got {fmt!r}")


_METRIC_NAMES = {"ndcg_at_10": "nDCG@10", "mrr_at_10": "MRR@10", "em": "EM", "f1": "F1"}


def _metric_name(key: str) -> str:
    m = _RECALL.match(key)
    return f"R@{m.group(1)}" if m else _METRIC_NAMES.get(key, key)


def comparisons_table(comparisons: Sequence[Mapping], fmt: str = "markdown", digits: int = 3) -> str:
    """The paired comparisons (`comparisons.run_comparisons`): A, B, metric, delta = mean(A - B),
    the two-sided p-value of the paired randomisation test, and the queries compared."""
    header = ["A", "B", "Dataset", "Metric", "Delta (A-B)", "p", "n"]
    body = [[str(c["a"]), str(c["b"]), str(c["dataset"]), _metric_name(str(c["metric"])),
             f"{float(c['delta']):+.{digits}f}", f"{float(c['p_value']):.{digits}f}", str(c["n"])] for c in comparisons]
    return _table(header, body, fmt, right_from=4)


SIZE_TESTS_INTRO = ("Label efficiency, RetroMAE's claim (the curve: metrics/eval/label_efficiency.png): ft:retromae "
                    "against each start fine-tuned on the same questions, at every training size (paired randomisation "
                    "test over queries; delta = mean(A - B), two-sided p; one seed, experiments/small_seeds.py pools seeds)")


def size_tests_table(tests: Sequence[Mapping], fmt: str = "markdown", digits: int = 3) -> str:
    """The per-size paired tests (`curve.size_tests`): one line per (set, size, B), a delta (p) cell per metric."""
    metrics = list(dict.fromkeys(str(t["metric"]) for t in tests))
    lines: dict[tuple, dict] = {}
    for t in tests:
        line = lines.setdefault((t["dataset"], t["size"], t["b"]), {"t": t, "cells": {}})
        line["cells"][t["metric"]] = f"{float(t['delta']):+.{digits}f} ({float(t['p_value']):.{digits}f})"
    header = ["Dataset", "Size", "Questions", "A", "B", *(f"{_metric_name(m)} delta (p)" for m in metrics), "n"]
    body = [[str(v["t"]["dataset"]), str(v["t"]["size"]), str(v["t"]["questions"]), str(v["t"]["a"]), str(v["t"]["b"]),
             *(v["cells"].get(m, "-") for m in metrics), str(v["t"]["n"])] for v in lines.values()]
    return _table(header, body, fmt, right_from=5)


def _table(header: Sequence[str], body: Sequence[Sequence[str]], fmt: str, right_from: int) -> str:
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] * right_from + ["---:"] * (len(header) - right_from)) + "|"]
        lines += ["| " + " | ".join(t.replace("|", "\\|") for t in line) + " |" for line in body]
        return "\n".join(lines) + "\n"
    if fmt == "html":
        th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        trs = "".join("<tr>" + "".join(f"<td>{html.escape(t)}</td>" for t in line) + "</tr>\n" for line in body)
        return f'<table class="results">\n<thead><tr>{th}</tr></thead>\n<tbody>\n{trs}</tbody>\n</table>\n'
    raise ValueError(f"fmt must be 'markdown' or 'html', got {fmt!r}")


def report_markdown(rows: Sequence[Mapping], title: str | None = None, comparisons: Sequence[Mapping] = (),
                    digits: int = 3, size_tests: Sequence[Mapping] = (), note: str | None = None) -> str:
    """The whole Markdown report: `title` as its first line (what was evaluated: split, preset),
    the results table, the paired comparisons, and the per-size tests of the label-efficiency curve.
    `note`: a paragraph after the title (with no rows, what the report says instead of a table)."""
    parts = [f"{title}\n"] if title else []
    if note:
        parts.append(f"{note}\n")
    if rows:
        parts.append(results_table(rows, "markdown", digits))
    if comparisons:
        parts.append("Paired comparisons (randomisation test over queries; delta = mean(A - B), two-sided p):\n")
        parts.append(comparisons_table(comparisons, "markdown", digits))
    if size_tests:
        parts.append(SIZE_TESTS_INTRO + ":\n")
        parts.append(size_tests_table(size_tests, "markdown", digits))
    return "\n".join(parts)


def recall_by_system(rows: Sequence[Mapping]) -> dict[str, dict[int, float]]:
    """{label: {k: recall@k}} from result rows; label is `system`, or `system / dataset` when rows span datasets."""
    many = len({r.get("dataset") for r in rows}) > 1
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        ks = {int(m.group(1)): float(v) for key, v in r.items() if (m := _RECALL.match(key)) and v is not None}
        if ks:
            label = f"{r.get('system')} / {r.get('dataset')}" if many else str(r.get("system"))
            out[label] = dict(sorted(ks.items()))
    return out


# ----------------------------------------------------------------------------------------------
# plots and CSVs
# ----------------------------------------------------------------------------------------------
def _csv(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # Agg canvas on this figure only; pyplot (and its global backend) unused
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()


def _recall_figure(recall: Mapping[str, Mapping[int, float]]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    ks = sorted({k for v in recall.values() for k in v})
    for label, by_k in recall.items():
        xs = sorted(by_k)
        ax.plot(xs, [by_k[k] for k in xs], marker="o", label=label)
    if ks and ks[-1] / max(ks[0], 1) >= 10:
        ax.set_xscale("log")  # k = 1..100 is unreadable on a linear axis
        ax.minorticks_off()
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("Recall@k")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Retrieval recall@k")
    return fig


def _curves_figure(curves: Mapping[str, Sequence[tuple[float, float]]]):
    from matplotlib.figure import Figure

    n = len(curves)
    fig = Figure(figsize=(4 * n, 3.2))
    for i, (name, points) in enumerate(curves.items()):
        ax = fig.add_subplot(1, n, i + 1)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, lw=1.2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    return fig


CURVE_COLUMNS = ("dataset", "start", "size", "questions", "kind", "ndcg_at_10", "recall_at_20")


def curve_csv(points: Sequence[Mapping]) -> str:
    """The label-efficiency points as CSV (`CURVE_COLUMNS`; the header alone when there are none)."""
    return _csv(CURVE_COLUMNS, [[p.get(c) for c in CURVE_COLUMNS] for p in points])


def recall_csv(recall: Mapping[str, Mapping[int, float]]) -> str:
    """recall@k per system as long-format CSV (system,k,recall; the header alone when there is none)."""
    return _csv(("system", "k", "recall"), [(label, k, v) for label, by_k in recall.items() for k, v in sorted(by_k.items())])


def _label_efficiency_figure(points: Sequence[Mapping]):
    """nDCG@10 and R@20 against training questions (log x), one line per start; the reference dashed."""
    from matplotlib.figure import Figure

    many = len({p["dataset"] for p in points}) > 1
    lines: dict[str, list[Mapping]] = {}
    for p in points:
        lines.setdefault(f"{p['start']} / {p['dataset']}" if many else str(p["start"]), []).append(p)
    xs = sorted({int(p["questions"]) for p in points})
    fig = Figure(figsize=(10, 4))
    for i, (metric, name) in enumerate((("ndcg_at_10", "nDCG@10"), ("recall_at_20", "R@20"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for label, pts in sorted(lines.items(), key=lambda kv: kv[1][0]["kind"] == "reference"):  # the reference last
            pts = [p for p in pts if p.get(metric) is not None]
            if pts and pts[0]["kind"] == "reference":  # zero-shot: one value whatever the size, across the axis
                ax.axhline(pts[0][metric], label=f"{label} (zero-shot)", ls="--", color="0.4")
            else:
                ax.plot([p["questions"] for p in pts], [p[metric] for p in pts], label=label, marker="o", ls="-")
        if xs and xs[-1] / max(xs[0], 1) >= 4:
            ax.set_xscale("log")  # 32 .. 10k questions: the paper's few-label end needs the room
            ax.minorticks_off()
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("training questions")
        ax.set_ylabel(name)
        ys = [p[metric] for pts in lines.values() for p in pts if p.get(metric) is not None]
        if ys:  # fitted to the points: the starts differ by a point or two, which an axis from 0 flattens
            pad = max(0.01, 0.1 * (max(ys) - min(ys)))
            ax.set_ylim(max(0.0, min(ys) - pad), min(1.0, max(ys) + pad))
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{name} after fine-tuning")
    ax.legend(fontsize=8)
    return fig


def write_plots(
    out_dir: str | os.PathLike,
    recall: Mapping[str, Mapping[int, float]] | None = None,
    curves: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    label_efficiency: Sequence[Mapping] = (),
) -> dict[str, Path]:
    """PNGs + long-format CSVs; returns {name: path} of what was written.

    recall: {system: {k: recall@k}} -> recall_at_k.png, recall_at_k.csv (system,k,recall)
    curves: {name: [(step, value), ...]} -> training_curves.png (one panel per name, side by
            side), training_curves.csv (name,step,value)
    label_efficiency: `curve.curve_points` -> label_efficiency.png, label_efficiency.csv (`CURVE_COLUMNS`)
    """
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    if label_efficiency:
        written["curve_csv"] = write_text_atomic(out_dir / "label_efficiency.csv", curve_csv(label_efficiency))
        written["curve_png"] = write_bytes_atomic(out_dir / "label_efficiency.png", _png(_label_efficiency_figure(label_efficiency)))
    if recall:
        written["recall_csv"] = write_text_atomic(out_dir / "recall_at_k.csv", recall_csv(recall))
        written["recall_png"] = write_bytes_atomic(out_dir / "recall_at_k.png", _png(_recall_figure(recall)))
    if curves:
        rows = [(name, step, value) for name, points in curves.items() for step, value in points]
        written["curves_csv"] = write_text_atomic(out_dir / "training_curves.csv", _csv(("name", "step", "value"), rows))
        written["curves_png"] = write_bytes_atomic(out_dir / "training_curves.png", _png(_curves_figure(curves)))
    return written


def write_report(
    out_dir: str | os.PathLike,
    rows: Sequence[Mapping],
    curves: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    digits: int = 3,
    title: str | None = None,
    comparisons: Sequence[Mapping] = (),
    label_efficiency: Sequence[Mapping] = (),
    size_tests: Sequence[Mapping] = (),
    note: str | None = None,
) -> dict[str, Path]:
    """results.md (`report_markdown`), results.html, comparisons.csv (when there are comparisons),
    and the plots/CSVs of `write_plots` (recall taken from `rows`; the label-efficiency curve's points).
    `note`: a paragraph before the table (the whole report when there are no rows)."""
    out_dir = Path(out_dir)
    body = f"<p>{html.escape(note)}</p>\n" if note else ""
    if rows:
        body += results_table(rows, "html", digits)
    if comparisons:
        body += "<p>Paired comparisons (randomisation test over queries):</p>\n" + comparisons_table(comparisons, "html", digits)
    if size_tests:
        body += f"<p>{html.escape(SIZE_TESTS_INTRO)}:</p>\n" + size_tests_table(size_tests, "html", digits)
    written = {
        "markdown": write_text_atomic(out_dir / "results.md", report_markdown(rows, title, comparisons, digits, size_tests, note)),
        "html": write_text_atomic(out_dir / "results.html", _html_page(body, title)),
    }
    if comparisons:
        keys = ("dataset", "a", "b", "metric", "delta", "p_value", "n", "question")
        written["comparisons_csv"] = write_text_atomic(out_dir / "comparisons.csv",
                                                       _csv(keys, [[c.get(k) for k in keys] for c in comparisons]))
    written.update(write_plots(out_dir, recall_by_system(rows), curves, label_efficiency))
    return written


def _html_page(table: str, title: str | None = None) -> str:
    heading = f"<p><b>{html.escape(title)}</b></p>\n" if title else ""
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>retro-realm results</title>\n"
            "<style>table.results{border-collapse:collapse;font-family:sans-serif}"
            "th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            "td:nth-child(-n+2),th:nth-child(-n+2){text-align:left}</style></head>\n"
            f"<body>\n{heading}{table}</body></html>\n")
