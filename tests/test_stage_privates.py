"""Stages are drivers only (issue 31): what a bench or a test needs from a stage lives in the library
(components/eval, components/training, ...), so no file under bench/, experiments/ or tests/ reaches for a private
(`_`-prefixed) name of `components.stages.*`: neither `from components.stages.x import _y` nor
`stage._y` on an imported stage module. A stage's public entry points (its body, e.g.
`finetune_reader`) stay importable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import ROOT


def private_stage_uses(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, `module.name`) for every private name of components.stages.* that `source` uses."""
    tree = ast.parse(source, filename=filename)
    aliases: dict[str, str] = {}  # local name -> the stage module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if node.module.startswith("components.stages") and a.name.startswith("_"):
                    found.append((node.lineno, f"{node.module}.{a.name}"))
                elif node.module == "components.stages" or node.module.startswith("components.stages."):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("components.stages.") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            found.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("components.stages.")
              and any(part.startswith("_") and not part.startswith("__") for part in node.value.split("."))):
            found.append((node.lineno, node.value))  # monkeypatch.setattr("components.stages.x._y", ...)
    return sorted(found)


def test_no_bench_or_test_uses_a_private_name_of_a_stage():
    files = [p for folder in ("bench", "experiments", "tests") for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__)]  # not its samples
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in files for line, name in private_stage_uses(p.read_text(encoding="utf-8"), str(p))]
    assert not bad, ("bench/, experiments/ and tests/ use private names of stage bodies; move what they need into the library "
                     "(components/eval, components/training, ...) and import it from there:\n  " + "\n  ".join(bad))


@pytest.mark.parametrize("src, expect", [
    ("from components.stages.evaluate import _warm_start_system\n", ["components.stages.evaluate._warm_start_system"]),
    ("import components.stages.pretrain_realm as stage\nstage._split_rows(1)\n", ["components.stages.pretrain_realm._split_rows"]),
    ("from components.stages import evaluate as ev\nev._x\n", ["components.stages.evaluate._x"]),
    ("m.setattr('components.stages.finetune_reader._skip_reason', f)\n", ["components.stages.finetune_reader._skip_reason"]),
    ("from components.stages.finetune_reader import finetune_reader\n", []),
    ("from components.eval.rows import _realm_index\nimport components.stages.evaluate as e\ne.__doc__\n", []),
])
def test_the_check_sees_each_way_of_reaching_a_private_name(src, expect):
    assert [name for _, name in private_stage_uses(src)] == expect
