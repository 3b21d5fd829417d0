"""Every project file a stage runs is one of its `dvc.yaml` deps, so an edit to any imported module
makes that stage (and what follows it) stale: `dvc repro` can never call a stage up to date after a
change to code it ran.

A stage's code is the import closure of its flow (`scripts/py -m flows.<stage>`) and of its stage body
(`components/stages/<group>.py` for a stage `<group>` or `<group>@<item>`, which torchrun launches by
module name, out of sight of the flow's imports). A dep names a file or a folder that covers it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import dvc_stages
from tests.test_layering import ROOT, _project_target, imports

DVC = dvc_stages()


def _file_of(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if (base / "__init__.py").is_file() else base.with_suffix(".py")


def import_closure(roots: list[str]) -> set[Path]:
    """Project files reachable from `roots` through imports (function-local ones too), without the
    package `__init__.py` files that hold nothing but a docstring (they only mark folders)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo.extend(".".join(parts[:n]) for n in range(1, len(parts)))  # a package's __init__ runs first
        for _, name, _ in imports(_file_of(mod)):
            target = _project_target(name)
            if target:
                todo.append(target)
    files = {_file_of(m) for m in seen}
    return {f for f in files if not (f.name == "__init__.py" and _only_docstring(f))}


def _only_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def stage_roots(stage: str) -> list[str]:
    cmd = DVC[stage]["cmd"]
    assert cmd.startswith("scripts/py -m "), f"dvc.yaml stage {stage}: expected `scripts/py -m <module>`, got {cmd!r}"
    roots = [cmd.split()[2]]
    group = stage.partition("@")[0]
    if (ROOT / "components" / "stages" / f"{group}.py").is_file():
        roots.append(f"components.stages.{group}")
    return roots


def _covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


@pytest.mark.parametrize("stage", sorted(DVC))
def test_every_imported_project_file_is_a_dep(stage):
    deps = [d if isinstance(d, str) else next(iter(d)) for d in DVC[stage].get("deps", [])]
    missing = sorted(str(f.relative_to(ROOT)) for f in import_closure(stage_roots(stage)) if not _covered(f, deps))
    assert not missing, (f"dvc.yaml stage {stage!r} runs these project files but does not list them in deps, "
                         f"so an edit to them would leave its outputs stale; add them:\n  - " + "\n  - ".join(missing))


def test_the_closure_follows_function_local_imports_and_the_stage_body():
    files = {str(f.relative_to(ROOT)) for f in import_closure(stage_roots("pretrain_mlm"))}
    assert "components/stages/pretrain_mlm.py" in files      # launched by torchrun, not imported by the flow
    assert "components/models/mlm.py" in files
    assert "components/config.py" in files
