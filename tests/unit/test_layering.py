"""The import layers (docs/layout.md): `detpipe/core/` imports nothing above it, `detpipe/vis/` only core, the
launcher never the engine, the engine never the evaluation (it gets its periodic evaluation as a callable), no two
project modules import each other through a cycle, and the evaluate stage's code deps hold no engine module."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ci_imports", ROOT / ".ci" / "imports.py")
ci_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_imports)
code_closure, project_file = ci_imports.code_closure, ci_imports.project_file

KNOWN_CYCLES: list[set[str]] = []   # none left (the models/data and serve cycles are gone)


def _closure_of_folder(folder: str) -> dict[str, set[str]]:
    return {f.relative_to(ROOT).as_posix(): code_closure(f) for f in sorted((ROOT / folder).glob("*.py"))}


def test_core_imports_nothing_above_it():
    for f, closure in _closure_of_folder("detpipe/core").items():
        above = sorted(m for m in closure if not m.startswith("detpipe/core/") and m != "detpipe/__init__.py")
        assert not above, f"{f} imports {above}"


def test_vis_imports_only_core():
    for f, closure in _closure_of_folder("detpipe/vis").items():
        above = sorted(m for m in closure if not m.startswith(("detpipe/core/", "detpipe/vis/"))
                       and m != "detpipe/__init__.py")
        assert not above, f"{f} imports {above}"


def test_launch_never_imports_the_engine_and_the_engine_never_the_evaluation():
    for folder, forbidden in (("detpipe/launch", "detpipe/engine/"), ("detpipe/engine", "detpipe/evaluation/"),
                              ("detpipe/engine", "detpipe/launch/")):
        for f, closure in _closure_of_folder(folder).items():
            crossed = sorted(m for m in closure if m.startswith(forbidden))
            assert not crossed, f"{f} imports {crossed}"


def test_evaluate_does_not_depend_on_the_engine():
    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]["deps"]
    engine = sorted(d for d in deps if isinstance(d, str) and d.startswith("detpipe/engine/"))
    assert not engine, f"evaluate's DVC deps include {engine}"


def _explicit_imports(path: Path) -> set[str]:
    """Project files ``path`` imports by name (anywhere in it, TYPE_CHECKING blocks too), without the enclosing
    packages Python runs implicitly."""
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("detpipe"):
            subs = [f"{node.module}.{a.name}" for a in node.names if project_file(f"{node.module}.{a.name}")]
            mods.update(subs)
            if len(subs) < len(node.names):
                mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.startswith("detpipe"))
    return {project_file(m).relative_to(ROOT).as_posix() for m in mods if project_file(m)}


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan's
    algorithm (Tarjan 1972), iterative."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop(); on.discard(w); comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph.get(v, ()):
                        out.append(comp)
    return out


def test_no_import_cycles_but_the_known_ones():
    graph = {f.relative_to(ROOT).as_posix(): _explicit_imports(f) for f in (ROOT / "detpipe").rglob("*.py")}
    cycles = import_cycles(graph)
    assert [c for c in cycles if c not in KNOWN_CYCLES] == [], cycles
    broken = {**graph, "detpipe/core/errors.py": graph["detpipe/core/errors.py"] | {"detpipe/core/files.py"}}
    assert any("detpipe/core/errors.py" in c for c in import_cycles(broken))  # the check finds a planted cycle
