"""experiments/small_seeds.py keeps what its p-values need: a finished seed is archived with its per-query
scores, archives from different sessions pool into one test, and a hand-written summary of a lost
workspace gives its per-seed test and stays out of the pooled one (no per-query scores to pool), which
the seeds that kept theirs still form."""

from __future__ import annotations

import json

import pytest

from experiments import small_seeds
from components.eval.comparisons import per_query_path
from components.eval.significance import paired_test


def _workspace(tmp_path, name: str, shift: float, scores: dict | None = None):
    """A finished run's files: metrics/eval.json and the per-query scores of retromae and mlm (or of
    `scores`; every system but the first is `shift` lower)."""
    ws = tmp_path / name
    scores = scores or {"retromae": [0.9, 0.8, 0.7, 0.6, 0.5], "mlm": [0.5, 0.6, 0.4, 0.3, 0.2]}
    first = next(iter(scores))
    rows = {}
    for system, vals in scores.items():
        path = per_query_path(ws / "metrics/eval", "main", system)
        path.parent.mkdir(parents=True, exist_ok=True)
        vals = [v - shift for v in vals] if system != first else vals
        path.write_text("".join(json.dumps({"qid": f"q{i}", "ndcg_at_10": v, "recall_at_20": 1.0}) + "\n"
                                for i, v in enumerate(vals)))
        rows[system] = {"ndcg_at_10": sum(vals) / len(vals), "recall_at_20": 1.0}
    (ws / "metrics/eval.json").write_text(json.dumps({"split": "test", "main": rows}))
    (ws / "wall_seconds.txt").write_text("125\n")
    return ws


@pytest.fixture
def archive_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(small_seeds, "ARCHIVE", tmp_path / "archive")
    monkeypatch.setattr(small_seeds, "stage_seconds", lambda ws: {"evaluate": 1.0})  # no MLflow store here
    return tmp_path / "archive"


def test_archives_pool_over_seeds_and_keep_each_seeds_test(tmp_path, archive_dir):
    ws0, ws1 = _workspace(tmp_path, "seed0", 0.0), _workspace(tmp_path, "seed1", 0.1)
    a0, a1 = small_seeds.archive(ws0, 0), small_seeds.archive(ws1, 1)
    assert a0 == archive_dir / "seed0.json.gz" and not list(archive_dir.glob("*.tmp"))
    rec = small_seeds.load_seed(a1)
    assert rec["seed"] == 1 and rec["wall_seconds"] == 125 and rec["per_query"]["mlm"]["q0"]["ndcg_at_10"] == pytest.approx(0.4)

    res = small_seeds.collect([a0, a1])
    c = next(c for c in res["comparisons"] if (c["a"], c["b"], c["metric"]) == ("retromae", "mlm", "ndcg_at_10"))
    assert [round(s["delta"], 6) for s in c["per_seed"]] == [0.3, 0.4]
    both_a = {f"{i}/q{j}": v for i in (0, 1) for j, v in enumerate([0.9, 0.8, 0.7, 0.6, 0.5])}
    both_b = {f"0/q{j}": v for j, v in enumerate([0.5, 0.6, 0.4, 0.3, 0.2])}
    both_b.update({f"1/q{j}": v - 0.1 for j, v in enumerate([0.5, 0.6, 0.4, 0.3, 0.2])})
    want = paired_test(both_a, both_b)
    assert c["pooled"]["n"] == 10 and c["pooled"]["delta"] == pytest.approx(want.delta) and c["pooled"]["p"] == want.p_value
    assert c["pooled"]["seeds"] == [0, 1]
    assert all("per_query" not in s for s in res["seeds"])  # the summary json stays small
    assert "| retromae | mlm | ndcg_at_10 | +0.300 (0.0625); +0.400 (0.0625) | +0.350 |" in small_seeds.markdown(res)
    # workspaces record no seed: their position names them, in the pooled test and the tables
    res = small_seeds.collect([ws0, ws1])
    assert res["comparisons"][0]["pooled"]["seeds"] == [0, 1] and "| Stage | seed 0 | seed 1 |" in small_seeds.markdown(res)


def test_a_summary_without_per_query_scores_stays_out_of_the_pooled_test(tmp_path, archive_dir):
    lost = tmp_path / "seed0.json"
    lost.write_text(json.dumps({"seed": 0, "split": "test", "rows": {"retromae": {"ndcg_at_10": 0.7}, "mlm": {"ndcg_at_10": 0.4}},
                                "per_query": None, "stage_seconds": {}, "wall_seconds": None,
                                "comparisons": [{"a": "retromae", "b": "mlm", "metric": "ndcg_at_10", "delta": 0.3, "p": 0.01, "n": 5}]}))
    res = small_seeds.collect([lost, small_seeds.archive(_workspace(tmp_path, "seed1", 0.1), 1)])
    c = next(c for c in res["comparisons"] if (c["a"], c["b"], c["metric"]) == ("retromae", "mlm", "ndcg_at_10"))
    assert [s["delta"] for s in c["per_seed"]][0] == 0.3 and c["per_seed"][0]["p"] == 0.01
    assert c["per_seed"][1]["delta"] == pytest.approx(0.4) and c["pooled"] is None
    assert "| retromae | mlm | ndcg_at_10 | +0.300 (0.0100); +0.400 (0.0625) | - | - | - |" in small_seeds.markdown(res)
    # with two more seeds that kept their per-query scores, those two pool; the summary stays out
    res = small_seeds.collect([lost, small_seeds.archive(_workspace(tmp_path, "seed1", 0.1), 1),
                               small_seeds.archive(_workspace(tmp_path, "seed2", 0.2), 2)])
    c = next(c for c in res["comparisons"] if (c["a"], c["b"], c["metric"]) == ("retromae", "mlm", "ndcg_at_10"))
    assert len(c["per_seed"]) == 3 and c["pooled"]["seeds"] == [1, 2] and c["pooled"]["n"] == 10
    assert c["pooled"]["delta"] == pytest.approx(0.45)
    md = small_seeds.markdown(res)
    assert "pooled over every (seed, query) pair of seeds 1, 2" in md and "| Stage | seed 0 | seed 1 | seed 2 |" in md
    assert "| **pipeline (wall)** | - | 125.0 | 125.0 |" in md


def test_the_curve_sizes_pool_over_seeds(tmp_path, archive_dir):
    """Every size the seeds fine-tuned on gets ft:retromae@N vs ft:mlm@N and vs ft:init@N, pooled."""
    vals = [0.9, 0.8, 0.7, 0.6, 0.5]
    systems = {name: vals for name in ("ft:retromae@8", "ft:mlm@8", "ft:init@8", "ft:retromae", "ft:mlm", "ft:init")}
    res = small_seeds.collect([small_seeds.archive(_workspace(tmp_path, f"seed{i}", 0.1 * (i + 1), systems), i) for i in (0, 1)])
    pairs = {(c["a"], c["b"]) for c in res["comparisons"]}
    assert {("ft:retromae@8", "ft:mlm@8"), ("ft:retromae@8", "ft:init@8"), ("ft:retromae", "ft:mlm"), ("ft:retromae", "ft:init")} <= pairs
    c = next(c for c in res["comparisons"] if (c["a"], c["b"], c["metric"]) == ("ft:retromae@8", "ft:mlm@8", "ndcg_at_10"))
    assert c["pooled"]["n"] == 10 and c["pooled"]["delta"] == pytest.approx(0.15) and 0 <= c["pooled"]["p"] <= 1
    md = small_seeds.markdown(res)
    table = md[md.index("Label efficiency"):].splitlines()
    assert table[4].startswith("| ft:retromae@8 | ft:mlm@8 | ndcg_at_10 | +0.100 (0.0625); +0.200 (0.0625) | +0.150 (")
    assert any(line.startswith("| ft:retromae | ft:init |") for line in table)  # the largest size last


def test_the_curve_is_averaged_over_the_seeds_that_recorded_it(tmp_path, archive_dir):
    """Each seed's label-efficiency points (metrics/eval.json) survive the archive and average per
    (set, start, size); a seed without them (an older archive) adds nothing."""
    def point(start, size, ndcg):
        return {"dataset": "main", "start": start, "size": size, "questions": 32 if size == 32 else 480,
                "kind": "fine-tuned", "ndcg_at_10": ndcg, "recall_at_20": 1.0}

    sources = []
    for i, (a, b) in enumerate([(0.5, 0.7), (0.6, 0.9)]):
        ws = _workspace(tmp_path, f"seed{i}", 0.0)
        table = json.loads((ws / "metrics/eval.json").read_text())
        table["label_efficiency"] = [point("retromae", 32, a), point("retromae", "all", b)]
        (ws / "metrics/eval.json").write_text(json.dumps(table))
        sources.append(small_seeds.archive(ws, i))
    older = tmp_path / "seed9.json"
    older.write_text(json.dumps({"seed": 9, "split": "test", "rows": {}, "per_query": None, "stage_seconds": {}, "wall_seconds": None}))
    curve = {(p["start"], p["size"]): p for p in small_seeds.collect([*sources, older])["label_efficiency"]}
    assert curve[("retromae", 32)]["ndcg_at_10"] == pytest.approx(0.55) and curve[("retromae", 32)]["seeds"] == 2
    assert curve[("retromae", "all")]["ndcg_at_10"] == pytest.approx(0.8) and curve[("retromae", "all")]["questions"] == 480


def test_a_second_run_of_a_seed_adds_its_rows_only_when_it_shares_the_first_ones_models(tmp_path, archive_dir, monkeypatch):
    """`--merge`: the ft:realm line, fine-tuned in a second run of seed 0, joins the first run's archive
    (rows, per-query scores, curve points, provenance) only where their anchors agree on every query."""
    monkeypatch.setattr(small_seeds, "ARCHIVE", tmp_path / "{name}_seeds")  # one folder per name, as in the repo
    base_ws = _workspace(tmp_path, "base", 0.1, {"retromae": [0.9, 0.8, 0.7], "ft:mlm": [0.9, 0.8, 0.7]})
    extra_ws = _workspace(tmp_path, "extra", 0.2, {"retromae": [0.9, 0.8, 0.7], "ft:realm": [0.9, 0.8, 0.7],
                                                   "ft:realm@32": [0.8, 0.8, 0.8]})
    table = json.loads((extra_ws / "metrics/eval.json").read_text())
    table["label_efficiency"] = [{"dataset": "main", "start": s, "size": 32, "questions": 32, "kind": k, "ndcg_at_10": 0.6,
                                  "recall_at_20": 1.0} for s, k in (("realm", "fine-tuned"), ("warm-start:mean", "reference"))]
    (extra_ws / "metrics/eval.json").write_text(json.dumps(table))
    base, extra = small_seeds.archive(base_ws, 0, "base"), small_seeds.archive(extra_ws, 0, "extra")

    (merged,) = small_seeds.merge_archives([(base, extra)], ["ft:realm*"], "merged")
    rec = small_seeds.load_seed(merged)
    assert sorted(rec["rows"]) == ["ft:mlm", "ft:realm", "ft:realm@32", "retromae"]
    assert rec["per_query"]["ft:realm@32"]["q1"]["ndcg_at_10"] == pytest.approx(0.6)  # EXTRA's scores
    assert [(p["start"], p["kind"]) for p in rec["label_efficiency"]] == [("realm", "fine-tuned")]
    assert rec["merged"][0]["systems"] == ["ft:realm", "ft:realm@32"] and rec["merged"][0]["anchors"] == ["retromae"]
    assert "| 0 | - + - (ft:realm, ft:realm@32) |" in small_seeds.markdown(small_seeds.collect([merged]))

    other = small_seeds.archive(_workspace(tmp_path, "other", 0.2, {"retromae": [0.9, 0.8, 0.6], "ft:realm": [0.9, 0.8, 0.7]}), 0, "o")
    with pytest.raises(ValueError, match="retromae differs by up to 0.1"):
        small_seeds.merge_archives([(base, other)], ["ft:realm*"], "merged")
    with pytest.raises(ValueError, match="seed/split 0/test against 1/test"):
        small_seeds.merge_archives([(base, small_seeds.archive(extra_ws, 1, "extra"))], ["ft:realm*"], "merged")
    with pytest.raises(ValueError, match="the base already has ft:mlm"):
        small_seeds.merge_archives([(base, small_seeds.archive(base_ws, 0, "again"))], ["ft:*"], "merged")


def test_the_realm_line_is_tested_against_retromae_at_each_size_it_has(tmp_path, archive_dir):
    """ft:realm@N vs ft:retromae@N (REALM starts from RetroMAE's encoder) wherever both lines have the point."""
    vals = [0.9, 0.8, 0.7, 0.6, 0.5]
    systems = {name: vals for name in ("ft:retromae@8", "ft:realm@8", "ft:retromae@16", "ft:retromae", "ft:realm")}
    res = small_seeds.collect([small_seeds.archive(_workspace(tmp_path, f"seed{i}", 0.1, systems), i) for i in (0, 1)])
    pairs = {(c["a"], c["b"]) for c in res["comparisons"] if c["a"].startswith("ft:realm")}
    assert pairs == {("ft:realm@8", "ft:retromae@8"), ("ft:realm", "ft:retromae")}  # no ft:realm@16 point
    c = next(c for c in res["comparisons"] if (c["a"], c["metric"]) == ("ft:realm@8", "ndcg_at_10"))
    assert c["pooled"]["delta"] == pytest.approx(-0.1)  # ft:realm@8 is `shift` below the first system
    assert "| ft:realm@8 | ft:retromae@8 | ndcg_at_10 |" in small_seeds.markdown(res)


def test_a_recipe_is_compared_with_a_baseline_recipe_seed_by_seed(tmp_path, archive_dir):
    """--against: each system of this recipe minus the same system of the baseline, paired over the
    (seed, query) pairs of matching seeds, and the stage times side by side."""
    def rec(seed: int, shift: float, wall: float) -> dict:
        r = small_seeds.load_seed(_workspace(tmp_path, f"r{seed}_{shift}", shift))
        return {**r, "seed": seed, "wall_seconds": wall}

    this, base = [rec(0, 0.1, 100.0), rec(1, 0.1, 110.0)], [rec(1, 0.0, 200.0), rec(0, 0.0, 190.0)]
    res = small_seeds.against(this, base)
    assert res["seeds"] == [0, 1]
    mlm = next(r for r in res["rows"] if (r["system"], r["metric"]) == ("mlm", "ndcg_at_10"))
    want = paired_test({f"{s}/q{j}": v - 0.1 for s in (0, 1) for j, v in enumerate([0.5, 0.6, 0.4, 0.3, 0.2])},
                       {f"{s}/q{j}": v for s in (0, 1) for j, v in enumerate([0.5, 0.6, 0.4, 0.3, 0.2])})
    assert mlm["delta"] == pytest.approx(-0.1) and mlm["p"] == want.p_value and mlm["n"] == 10
    retromae = next(r for r in res["rows"] if (r["system"], r["metric"]) == ("retromae", "ndcg_at_10"))
    assert retromae["delta"] == 0.0  # the first system is not shifted
    wall = next(t for t in res["seconds"] if t["stage"] is None)
    assert (wall["this"], wall["baseline"]) == (105.0, 195.0)
    text = "\n".join(small_seeds.against_markdown(res))
    assert "| mlm | ndcg_at_10 |" in text and "| **pipeline (wall)** | 105.0 | 195.0 | 0.54 |" in text

    with pytest.raises(ValueError, match="no baseline archive for seed 1"):
        small_seeds.against(this, base[1:])
    with pytest.raises(ValueError, match="seed 0 .* its baseline on dev"):
        small_seeds.against(this[:1], [{**base[1], "split": "dev"}])


def test_the_command_line_compares_archives_against_a_baseline(tmp_path, archive_dir, monkeypatch, capsys):
    monkeypatch.setattr(small_seeds, "RESULTS", tmp_path / "{name}_seeds.json")
    paths = {}
    for name, shift in (("this", 0.1), ("base", 0.0)):
        monkeypatch.setattr(small_seeds, "ARCHIVE", tmp_path / name)
        paths[name] = [small_seeds.archive(_workspace(tmp_path, f"{name}{s}", shift), s, name) for s in (0, 1)]
    monkeypatch.setattr("sys.argv", ["small_seeds", "--name", "this", "--collect", *map(str, paths["this"]),
                                     "--against", *map(str, paths["base"])])
    small_seeds.main()
    res = json.loads((tmp_path / "this_seeds.json").read_text())
    assert res["against"]["seeds"] == [0, 1] and {r["system"] for r in res["against"]["rows"]} == {"retromae", "mlm"}
    assert "Against the baseline" in capsys.readouterr().out


def test_a_run_against_a_baseline_without_its_seeds_is_refused_before_it_starts(tmp_path, archive_dir, monkeypatch, capsys):
    base = small_seeds.archive(_workspace(tmp_path, "base1", 0.0), 1, "base")  # a test-split run of seed 1
    monkeypatch.setattr(small_seeds, "run_seed", lambda *a, **k: pytest.fail("ran a seed"))
    monkeypatch.setattr("sys.argv", ["small_seeds", "--seeds", "1", "2", "--split", "dev", "--against", str(base)])
    with pytest.raises(SystemExit):
        small_seeds.main()
    assert "no dev-split run of seed(s) [1, 2]" in capsys.readouterr().err
