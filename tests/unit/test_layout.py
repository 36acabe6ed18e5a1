"""The layout the project promises: six stage modules, a library package, dvc.yaml deps that follow the imports,
the launcher and the workers' code apart."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ci_imports", ROOT / ".ci" / "imports.py")
ci_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_imports)
code_closure, _imports, _module_file = ci_imports.code_closure, ci_imports.imports, ci_imports.project_file
STAGES = ("download", "convert", "augment", "train", "evaluate", "export")


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
    a function (what they share lives beside both: `detpipe.models`, `detpipe.params`, `detpipe.core.worker_env`)."""
    sides = {"launch": "detpipe.engine", "engine": "detpipe.launch"}
    for side, forbidden in sides.items():
        for f in sorted((ROOT / "detpipe" / side).glob("*.py")):
            crossed = sorted(m for m in code_closure(f) if m.startswith(forbidden.replace(".", "/") + "/"))
            assert not crossed, f"{f.relative_to(ROOT)} imports {forbidden} ({crossed})"

def test_train_and_evaluate_do_not_depend_on_the_coco_reader():
    """The convert stage's COCO reader (streaming JSON, index, split, annotation cleaning) is convert's alone: train
    and evaluate share only the schema and rules (`detpipe/data/coco_schema.py`, through the evaluation's COCO
    metrics), so editing the reader reruns neither of them."""
    reader = ("detpipe/data/coco_reader.py", "detpipe/data/coco_json.py")
    for name in ("train", "evaluate"):
        closure = code_closure(ROOT / "stages" / f"{name}.py")
        assert not closure.intersection(reader), f"stages/{name}.py depends on the COCO reader"
        assert "detpipe/data/coco_schema.py" in closure, f"stages/{name}.py no longer reaches the COCO schema"
    assert set(reader) <= set(code_closure(ROOT / "stages" / "convert.py"))


def test_job_descriptions_are_not_train_deps():
    """``python -m detpipe.launch.emit slurm|k8s`` is outside the train stage's import graph: dvc.yaml's train deps
    list neither `detpipe/launch/emit.py` nor `detpipe/launch/k8s.py`, so editing the Kubernetes manifest code leaves
    trained models valid. `detpipe/launch/slurm.py` stays a dep (``train.launcher: slurm``: the train stage writes,
    submits and follows its script), and emit's Slurm script is that same code (docs/multi-node.md)."""
    train = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["deps"]
    deps = {d if isinstance(d, str) else next(iter(d)) for d in train}
    assert not deps & {"detpipe/launch/emit.py", "detpipe/launch/k8s.py"}, sorted(deps)
    assert not code_closure(ROOT / "stages/train.py") & {"detpipe/launch/emit.py", "detpipe/launch/k8s.py"}
    assert {"detpipe/launch/slurm.py", "detpipe/launch/jobs.py", "detpipe/launch/torchrun.py"} <= deps
    emit = code_closure(ROOT / "detpipe/launch/emit.py")
    assert {"detpipe/launch/k8s.py", "detpipe/launch/jobs.py", "detpipe/launch/slurm.py"} <= emit


def test_one_launch_path_for_train_and_evaluate():
    """Both stages that start workers do it through `detpipe.launch.stage.run_stage`; evaluate builds no train params
    to be launched (its own `LaunchParams.of_evaluate`)."""
    for f in ("stages/train.py", "detpipe/evaluation/evaluate.py"):
        assert "detpipe.launch.stage" in _imports(ROOT / f), f
    assert "Train(" not in (ROOT / "detpipe/evaluation/evaluate.py").read_text()


def test_the_trainer_imports_no_evaluation_code():
    """The engine's trainer gets its periodic evaluation as a callable (`build_trainer`'s ``eval_fn_factory``, which
    the train stage fills with `detpipe.evaluation.periodic.make_eval_fn`): neither it nor the hooks import
    `detpipe.evaluation`, directly or through another module."""
    for f in ("detpipe/engine/trainer.py", "detpipe/engine/hooks.py", "detpipe/engine/train_loop.py"):
        crossed = sorted(m for m in code_closure(ROOT / f) if m.startswith("detpipe/evaluation/")
                         and m != "detpipe/vis/drawing.py" and m != "detpipe/evaluation/__init__.py")
        assert not crossed, f"{f} imports {crossed}"
    assert "detpipe/evaluation/periodic.py" in code_closure(ROOT / "stages/train.py")


def test_one_helper_per_concern():
    """Each of these is done in one module only: PNG encoding (`detpipe.vis.drawing.encode_png`), server
    sockets (`detpipe.core.net.bind_listener`), saving a torch file (`detpipe.core.model_file`), box conversions (torchvision's ``box_convert`` through `detpipe.core.boxes`)."""
    rules = {"torchvision.io import encode_png": {"drawing.py"}, "setsockopt(": {"net.py"}, "torch.save(": {"model_file.py"},
             "import box_convert": {"boxes.py"}}
    for needle, allowed in rules.items():
        found = {f.name for f in (ROOT / "detpipe").rglob("*.py") if needle in f.read_text()}
        assert found <= allowed, f"{needle!r} in {sorted(found - allowed)}"


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
