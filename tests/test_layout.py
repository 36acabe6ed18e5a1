"""The layout the project promises: six stage modules, a library package, dvc.yaml deps that follow the imports,
the launcher and the workers' code apart."""
from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("download", "convert", "augment", "train", "evaluate", "export")


def _module_file(module: str) -> Path | None:
    """The file of project module ``module`` (``detpipe.data.coco`` -> detpipe/data/coco.py, a package -> its
    ``__init__.py``), or None when it is not one of the project's."""
    base = ROOT / module.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(path: Path) -> set[str]:
    """Project modules (``detpipe...``, ``stages...``) imported anywhere in ``path``, as dotted names: for ``from
    package import name`` the submodule when ``name`` is one, else the package; every enclosing package too
    (importing ``detpipe.data.coco`` runs ``detpipe/data/__init__.py``)."""
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("detpipe", "stages"):
                mods.add(node.module)
                mods.update(f"{node.module}.{a.name}" for a in node.names
                            if _module_file(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.split(".")[0] in ("detpipe", "stages"))
    for mod in list(mods):
        parts = mod.split(".")
        mods.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return {m for m in mods if _module_file(m)}


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
        todo.extend(_module_file(mod) for mod in _imports(f))
    return seen


def test_stages_holds_the_six_stages_only():
    found = {p.stem for p in (ROOT / "stages").glob("*.py")} - {"__init__"}
    assert found == set(STAGES)


def test_no_stage_imports_another_stage():
    for name in STAGES:
        imported = {m for m in _imports(ROOT / "stages" / f"{name}.py") if m.startswith("stages.")}
        assert not imported, f"stages/{name}.py imports {sorted(imported)}"
    for lib in (ROOT / "detpipe").rglob("*.py"):
        imported = {m for m in _imports(lib) if m.startswith("stages.")}
        assert not imported, f"{lib.name} imports stages {sorted(imported)}"



def test_launcher_and_workers_import_nothing_from_each_other():
    """The two sides of the train stage's process boundary: `detpipe/launch/` (the launcher: torchrun's agent,
    Slurm, Kubernetes, the input check) imports no module of `detpipe/engine/` (what runs in every worker), and
    `detpipe/engine/` none of `detpipe/launch/` -- directly or through another project module, at the top or inside
    a function (what they share lives beside both: `detpipe.models`, `detpipe.params`, `detpipe.worker_env`)."""
    sides = {"launch": "detpipe.engine", "engine": "detpipe.launch"}
    for side, forbidden in sides.items():
        for f in sorted((ROOT / "detpipe" / side).glob("*.py")):
            crossed = sorted(m for m in code_closure(f) if m.startswith(forbidden.replace(".", "/") + "/"))
            assert not crossed, f"{f.relative_to(ROOT)} imports {forbidden} ({crossed})"

def test_dvc_yaml_code_deps_follow_the_imports():
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in STAGES:
        deps = {d if isinstance(d, str) else next(iter(d)) for d in pipeline[name]["deps"]}
        code = {d for d in deps if d.endswith(".py")}
        want = code_closure(ROOT / "stages" / f"{name}.py") - {"detpipe/__init__.py", "stages/__init__.py"}
        assert code == want, f"{name}: dvc.yaml lists {sorted(code - want)} extra, misses {sorted(want - code)}"


def test_every_param_is_described():
    """Every field of every params section carries a description (the Prefect deployment's schema shows it)."""
    from detpipe import params as params_mod

    for section, field in params_mod.Params.model_fields.items():
        assert field.description, section
        for name, info in field.annotation.model_fields.items():
            assert info.description and len(info.description) > 10, f"{section}.{name} has no description"
