"""experiments/orqa_reader_ablation.py --pool: calls in several workspaces (pre-training seeds) pool
into one test per comparison, and each file keeps its own test. A question id is unique within one
file only, so the same id in two files is two pairs, never one."""

from __future__ import annotations

import gzip
import json

import pytest

from components.eval.significance import paired_test
from experiments import orqa_reader_ablation as A


def _per_query(path, em: dict[str, dict[str, list[float]]]):
    """A call's *_per_query.json.gz: {variant: {system: {qid: {em, f1}}}} from EM lists (F1 = EM)."""
    body = {v: {s: {f"q{i}": {"em": x, "f1": x} for i, x in enumerate(vals)} for s, vals in systems.items()}
            for v, systems in em.items()}
    path.write_bytes(gzip.compress(json.dumps(body).encode()))
    return path


def test_pool_tests_each_file_and_every_file_question_pair(tmp_path):
    one = _per_query(tmp_path / "s1.json.gz", {
        "base": {"qa:closed-book": [0, 0, 0, 0], "qa:bm25": [0, 1, 0, 0], "qa:realm": [1, 0, 0, 0]},
        "k3": {"qa:closed-book": [0, 0, 0, 0], "qa:bm25": [0, 1, 0, 0], "qa:realm": [1, 1, 0, 0]}})
    two = _per_query(tmp_path / "s2.json.gz", {
        "base": {"qa:closed-book": [0, 0, 0], "qa:bm25": [1, 1, 0], "qa:realm": [0, 0, 0]},
        "k3": {"qa:closed-book": [0, 0, 0], "qa:bm25": [1, 0, 0], "qa:realm": [0, 0, 1]}})
    res = A.pool([one, two])
    by = {(c["a"], c["b"], c["metric"]): c for c in res["comparisons"]}
    assert res["variants"] == ["base", "k3"] and res["pooled_from"] == ["s1.json.gz", "s2.json.gz"]
    c = by[("k3 qa:realm", "base qa:realm", "em")]
    assert c["n"] == 7  # 4 + 3 questions: q0..q2 of the two files are different questions
    assert c["delta"] == pytest.approx(round(2 / 7, 4))
    assert [d for d, _ in c["per_file"]] == [0.25, pytest.approx(round(1 / 3, 4))]
    assert c["p"] == round(paired_test({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "e": 0.0, "f": 0.0, "g": 0.0},
                                       {k: 0.0 for k in "abcdefg"}).p_value, 4)
    # within a variant, the systems of PAIRS; closed-book is never a variant-vs-base row of its own
    assert by[("k3 qa:realm", "k3 qa:bm25", "f1")]["delta"] == pytest.approx(round(1 / 7, 4))  # +1 in file 1, 0 in file 2
    assert by[("base qa:realm", "base qa:closed-book", "em")]["delta"] == pytest.approx(round(1 / 7, 4))
    assert not any(c["a"].endswith("qa:closed-book") for c in res["comparisons"])


def test_pool_refuses_files_of_different_variants(tmp_path):
    one = _per_query(tmp_path / "s1.json.gz", {"base": {"qa:bm25": [1]}, "k3": {"qa:bm25": [1]}})
    two = _per_query(tmp_path / "s2.json.gz", {"base": {"qa:bm25": [1]}, "lr": {"qa:bm25": [1]}})
    with pytest.raises(SystemExit, match="different variants"):
        A.pool([one, two])


def test_the_command_line_pools_into_out(tmp_path, capsys):
    files = [_per_query(tmp_path / f"s{i}.json.gz", {"base": {"qa:realm": [0, 1]}, "k3": {"qa:realm": [1, 1]}})
             for i in (1, 2)]
    out = tmp_path / "pooled.json"
    res = A.main(["--out", str(out), "--pool", *map(str, files)])
    assert json.loads(out.read_text()) == res
    assert "k3 qa:realm - base qa:realm em: +0.5000 (p" in capsys.readouterr().out


def test_one_call_compares_each_variant_with_the_first_and_the_systems_within_each():
    def variant(name, realm, bm25):
        return {"name": name, "per_query": {"qa:realm": {f"q{i}": {"em": x, "f1": x} for i, x in enumerate(realm)},
                                            "qa:bm25": {f"q{i}": {"em": x, "f1": x} for i, x in enumerate(bm25)}}}
    rows = A.compare([variant("base", [1, 0, 0, 0], [0, 1, 0, 0]), variant("joint", [1, 1, 0, 0], [0, 0, 0, 0])])
    by = {(c["a"], c["b"], c["system"], c["metric"]): c for c in rows}
    assert by[("joint", "base", "qa:realm", "em")]["delta"] == 0.25
    assert by[("joint", "base", "qa:bm25", "em")]["delta"] == -0.25
    assert by[("joint qa:realm", "joint qa:bm25", "", "em")]["delta"] == 0.5
    assert by[("base qa:realm", "base qa:bm25", "", "f1")]["delta"] == 0.0
    assert len(rows) == 2 * 2 + 2 * 2  # no closed-book or realm-stale here: their PAIRS rows are skipped

