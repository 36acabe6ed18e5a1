"""The project's import graph, read from the source (ast, nothing imported): which project modules a file imports,
and the transitive closure of a stage's imports, which is what dvc.yaml lists as that stage's code deps.

Used by `.ci/sync_dvc_deps.py` (rewrites the deps) and tests/unit/test_layout.py (checks them and the layout).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_file(module: str) -> Path | None:
    """The file of project module ``module`` (``detpipe.data.coco_schema`` -> detpipe/data/coco_schema.py, a package -> its
    ``__init__.py``), or None when it is not one of the project's."""
    base = ROOT / module.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def imports(path: Path) -> set[str]:
    """Project modules (``detpipe...``, ``stages...``) imported anywhere in ``path``, as dotted names: for ``from
    package import name`` the submodule when ``name`` is one, else the package; every enclosing package too
    (importing ``detpipe.data.coco_schema`` runs ``detpipe/data/__init__.py``)."""
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("detpipe", "stages"):
                mods.add(node.module)
                mods.update(f"{node.module}.{a.name}" for a in node.names
                            if project_file(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.split(".")[0] in ("detpipe", "stages"))
    for mod in list(mods):
        parts = mod.split(".")
        mods.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return {m for m in mods if project_file(m)}


def code_closure(module_file: Path) -> set[str]:
    """Repository-relative paths of ``module_file`` and every project module it imports, transitively."""
    seen: set[str] = set()
    todo = [module_file]
    while todo:
        f = todo.pop()
        rel = f.relative_to(ROOT).as_posix()
        if rel in seen:
            continue
        seen.add(rel)
        todo.extend(project_file(mod) for mod in imports(f))
    return seen
