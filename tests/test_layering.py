"""Dependencies point one way: a module imports only from its own layer or lower ones.

    config / io / paths  ->  data  ->  models  ->  index, retrieval  ->  training  ->  eval
        ->  stages (and tracking)  ->  flows

`components/tracking.py` (the MLflow run contract) sits with the stages: the library below them
takes a `run` or a `log_fn` as an argument, so data, models, index, training and eval run and test
without MLflow. Every import is read from the source (function-local ones too; `if TYPE_CHECKING:`
blocks are skipped, they never run). `components/` never imports Prefect: flows wrap it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "flows")

LAYERS = ["base", "data", "models", "index/retrieval", "training", "eval", "stages", "flows"]
RANK = {name: i for i, name in enumerate(LAYERS)}
_BY_PREFIX = {  # dotted module prefix -> layer; the longest matching prefix wins
    "components.config": "base", "components.config_file": "base", "components.config_shared": "base",
    "components.config_stages": "base", "components.cpuinfo": "base", "components.io": "base", "components.paths": "base", "components.progress": "base",
    "components.quiet_logs": "base",
    "components.data": "data",
    "components.models": "models",
    "components.index": "index/retrieval", "components.retrieval": "index/retrieval",
    "components.training": "training",
    "components.eval": "eval",
    "components.tracking": "stages", "components.tracking_server": "stages", "components.metric_buffer": "stages",
    "components.stages": "stages",
    "flows": "flows",
}


def layer_of(module: str) -> str | None:
    """The layer of a dotted project module name; None for a module no rule covers."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        hit = _BY_PREFIX.get(".".join(parts[:n]))
        if hit:
            return hit
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, source text) for every import in `path` that can run, at any depth."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    return parse_imports(path.read_text(encoding="utf-8"), package, str(path))


def parse_imports(source: str, package: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # only the `else:` branch runs
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((node.lineno, alias.name, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from components.data import beir` may name the submodule components.data.beir
            for alias in node.names:
                found.append((node.lineno, f"{target}.{alias.name}", ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, filename=filename))
    return found


def _project_target(name: str) -> str | None:
    """The project module an import names (its longest prefix that is one), else None."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for n in range(len(parts), 0, -1):
        cand = ROOT.joinpath(*parts[:n])
        if cand.with_suffix(".py").is_file() or (cand / "__init__.py").is_file():
            return ".".join(parts[:n])
    return None


def test_every_project_module_has_a_layer():
    missing = [module_name(p) for p in project_modules() if layer_of(module_name(p)) is None
               and module_name(p) not in PACKAGES and p.name != "__init__.py"]
    assert not missing, f"modules with no layer (add their prefix to _BY_PREFIX in {Path(__file__).name}): {missing}"


def test_imports_point_down_the_layers():
    bad = []
    for path in project_modules():
        me = module_name(path)
        mine = layer_of(me)
        if mine is None:
            continue  # the package roots (components/__init__.py): nothing to import
        for line, name, src in imports(path):
            target = _project_target(name)
            theirs = layer_of(target) if target else None
            if theirs is not None and RANK[theirs] > RANK[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {me} ({mine}) imports {target} ({theirs}): `{src}`")
    assert not bad, ("a lower layer imports a higher one (order: " + " -> ".join(LAYERS) + "):\n  " + "\n  ".join(bad))


# The MLM baseline is the RetroMAE driver with another model: it shares the driver by design.
_STAGE_TO_STAGE = {("components.stages.pretrain_mlm", "components.stages.pretrain_retromae")}


def test_stage_bodies_do_not_import_each_other():
    """What two stages share lives in stages/common.py or a lower layer, so a change to one stage's
    body never reaches into another stage (nor reruns it under DVC)."""
    bad = []
    for path in (ROOT / "components" / "stages").glob("*.py"):
        me = module_name(path)
        for line, name, src in imports(path):
            target = _project_target(name)
            if (target and target.startswith("components.stages.") and target not in (me, "components.stages.common")
                    and (me, target) not in _STAGE_TO_STAGE):
                bad.append(f"{path.relative_to(ROOT)}:{line}: `{src}`")
    assert not bad, "a stage body imports another stage body (move the shared piece down a layer):\n  " + "\n  ".join(bad)


def test_components_never_import_prefect():
    bad = [f"{p.relative_to(ROOT)}:{line}: `{src}`" for p in project_modules() if p.parts[len(ROOT.parts)] == "components"
           for line, name, src in imports(p) if name.split(".")[0] == "prefect"]
    assert not bad, "components/ is a plain library; only flows/ may import prefect:\n  " + "\n  ".join(bad)


def test_only_the_stage_layer_talks_to_mlflow():
    """The record of a run has one home: data, models, index, training and eval take a `run` or a
    `log_fn` and never import MLflow themselves (docs/architecture.md, "The record of a run")."""
    bad = [f"{p.relative_to(ROOT)}:{line}: `{src}`" for p in project_modules()
           if (layer := layer_of(module_name(p))) is not None and RANK[layer] < RANK["stages"]
           for line, name, src in imports(p) if name.split(".")[0] == "mlflow"]
    assert not bad, "a library module below stages/ imports mlflow (take a run / log_fn instead):\n  " + "\n  ".join(bad)


def test_bench_never_imports_experiments():
    """Outside the package, imports point one way too: a study in experiments/ may use a bench helper
    (bench/workspace.py), a benchmark never reaches for a study (bench/ and experiments/ READMEs)."""
    bad = [f"{p.relative_to(ROOT)}:{line}: `{src}`" for p in sorted((ROOT / "bench").rglob("*.py"))
           for line, name, src in imports(p) if name.split(".")[0] == "experiments"]
    assert not bad, "bench/ imports experiments/ (move the shared piece into bench/ or components/):\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("src, expect", [
    ("from components.stages.finetune import X\n", ["components.stages.finetune.X"]),
    ("def f():\n    import components.eval.metrics\n", ["components.eval.metrics"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from components.eval import x\n", ["typing.TYPE_CHECKING"]),
    ("from ..eval import metrics\n", ["components.eval.metrics"]),
])
def test_the_reader_sees_local_imports_and_skips_type_checking(src, expect):
    assert [name for _, name, _ in parse_imports(src, "components.models")] == expect
