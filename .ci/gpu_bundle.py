"""Build the GPU bundle: the cp312 manylinux wheels that the lent GPU machine lacks for the GPU run
(`.ci/gpu_run.py`: ``pytest -m gpu``, ``benchmarks.gpu_train``, ``benchmarks.nvjpeg``), into ``.gpu-bundle/``
(git-ignored; name it in the device tool's ``carry``). Run from the repository root where PyPI is reachable:

    python3 .ci/gpu_bundle.py          # any Python with pip; writes .gpu-bundle/ and .gpu-bundle/MANIFEST

That machine has Python 3.12 with torch 2.11 / torchvision 0.26 and the distributions listed in
``.ci/gpu_machine_packages.txt``, and reaches no registry. The bundle is derived from that list:

* `ROOTS` names the distributions that our code run by the GPU steps imports and that list lacks, each with the
  module of ours that imports it;
* their dependencies are followed through each wheel's own ``Requires-Dist`` (markers evaluated for CPython 3.12
  on Linux x86-64, extras left out) until a name is on the machine's list: everything reached is bundled, so a
  dependency imported late (dvclive's ``dvc.repo`` when it looks for a repository) is there too;
* `OVERRIDES` names the few on that list carried anyway, each with the pin that needs a version the list does not
  promise (the carried one comes first on ``PYTHONPATH`` there);
* every wheel is downloaded with ``--no-deps`` at requirements.txt's pin (a name without a pin is an error),
  for ``cp312`` / ``abi3`` / pure Python on manylinux x86-64; a distribution published only as a source archive
  (pure Python: antlr4-python3-runtime) is built into a wheel here with ``pip wheel --no-deps``.

Refused with one line: a root on the machine's list, a name without a pin, a bundle over 40 MiB (`LIMIT`). The
list is complete when the dry run passes (docs/testing.md, "GPU tier").
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".gpu-bundle"
LIMIT = 40 * 2**20  # bytes: the bundle travels with the working tree (64 MiB in all)

ROOTS = {
    "pydantic": "detpipe.params (the validated params.yaml schema)",
    "ruamel.yaml": "detpipe.params (comment-keeping YAML)",
    "dvclive": "detpipe.engine.hooks.MetricsHook (training curves in dvclive/)",
    "orjson": "detpipe.data.coco_reader / cocoarrow (the convert stage's JSON reader)",
    "pycocotools": "detpipe.data (RLE masks); torchvision.datasets.CocoDetection in the benchmarks",
    "faster-coco-eval": "detpipe.evaluation.coco_metrics (the default COCOeval backend)",
}

# On the machine's list, but carried anyway: a pin of ours needs a version the list does not promise.
OVERRIDES = {
    "typing-extensions": "pydantic 2.14.3 (needs >= 4.16.0; the machine's version is not documented)",
    "transformers": ("detpipe.models.transformers_family (RT-DETRv2, D-FINE): the machine has 5.17.0 (KINDS.md), "
                     "our configs and tests are of requirements.txt's pin"),
}

PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
            "--platform", "any"]

MARKERS = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": ""}


def norm(name: str) -> str:
    """PEP 503 normalized name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def names_in(path: Path) -> set[str]:
    return {norm(line.strip()) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def pins() -> dict[str, str]:
    """requirements.txt's ``name==version`` lines by normalized name."""
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line)
        if m:
            found[norm(m.group(1))] = f"{m.group(1)}=={m.group(2)}"
    return found


def pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet"], capture_output=True, text=True)
    if proc.returncode:
        errors = "\n".join(l for l in proc.stderr.splitlines() if "is ignored: it is neither" not in l)
        sys.exit(f"gpu_bundle: pip {' '.join(args[:1])} failed:\n{errors}")


def fetch(spec: str, dest: Path) -> Path:
    """The wheel of ``spec`` (``name==version``) in ``dest``: downloaded for the GPU machine's platform, or built
    here from the source archive when PyPI has no such wheel."""
    before = set(dest.glob("*.whl"))
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           *PLATFORM, "-d", str(dest), spec], capture_output=True, text=True)
    if proc.returncode:  # no wheel for that platform: a pure-Python source archive builds into one
        pip("wheel", "--no-deps", "--no-binary", spec.split("==")[0], "-w", str(dest), spec)
        (new,) = set(dest.glob("*.whl")) - before
        if not new.name.endswith("-none-any.whl"):
            sys.exit(f"gpu_bundle: {spec} has no cp312 manylinux wheel and builds only for this machine ({new.name})")
        return new
    (new,) = set(dest.glob("*.whl")) - before
    return new


def requires(wheel: Path) -> list[str]:
    """The names ``wheel`` requires on CPython 3.12 / Linux x86-64 (its METADATA's ``Requires-Dist``, without
    extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(MARKERS):
                out.append(req.name)
    return out


def main() -> None:
    machine = names_in(ROOT / ".ci/gpu_machine_packages.txt")
    pinned = pins()
    clash = [r for r in ROOTS if norm(r) in machine]
    if clash:
        sys.exit(f"gpu_bundle: {clash} are on the GPU machine already (.ci/gpu_machine_packages.txt)")
    tmp = OUT.with_name(OUT.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    why: dict[str, str] = {norm(r): reason for r, reason in {**ROOTS, **OVERRIDES}.items()}
    queue, wheels = list(why), {}
    while queue:
        name = queue.pop(0)
        if name in wheels:
            continue
        if name not in pinned:
            sys.exit(f"gpu_bundle: {name} (needed by {why[name]}) has no pin in requirements.txt")
        wheels[name] = fetch(pinned[name], tmp)
        for dep in map(norm, requires(wheels[name])):
            if dep not in machine and dep not in wheels and dep not in queue:
                why.setdefault(dep, f"{name}")
                queue.append(dep)
    size = sum(w.stat().st_size for w in wheels.values())
    if size > LIMIT:
        sys.exit(f"gpu_bundle: {size} bytes of wheels, over the {LIMIT // 2**20} MiB limit")
    lines = [f"{w.name}\t{why[n]}" for n, w in sorted(wheels.items())]
    (tmp / "MANIFEST").write_text("\n".join(lines) + "\n")
    shutil.rmtree(OUT, ignore_errors=True)
    tmp.rename(OUT)
    print(f"gpu_bundle: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {OUT.relative_to(ROOT)}/ "
          f"(limit {LIMIT // 2**20} MiB); wheel and what needs it:")
    for line in lines:
        print("  " + line.replace("\t", "  <- "))


if __name__ == "__main__":
    main()
