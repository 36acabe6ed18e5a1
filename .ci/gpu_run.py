"""The GPU run in one call: install the bundle, print the versions, run the GPU tier and the two GPU benchmarks,
each under its own time limit, all within 9 minutes; logs and one summary JSON go into OUT_DIR.

Run from the repository root on the GPU machine (Python 3.12 with torch and torchvision; .gpu-bundle/ carried
beside the working tree: `bash .ci/gpu_bundle.sh` builds it here):

    python3 .ci/gpu_run.py OUT_DIR [--site /tmp/detpipe-site] [--budget 480]

Steps, in order (each one's limit is also capped by what is left of ``--budget`` seconds):

1. ``install`` (45 s): ``pip install --no-index --no-deps --target SITE .gpu-bundle/*.whl``; SITE goes first on
   ``PYTHONPATH`` for every later step and the processes they start;
2. ``versions`` (45 s): GPU name, compute capability and memory, driver (nvidia-smi), Python, torch, torchvision,
   CUDA, cuDNN and NCCL versions;
3. ``imports`` (45 s): every module the later steps and their subprocesses import (an incomplete bundle fails
   here, naming the module, not half-way through a test);
4. ``pytest_gpu`` (330 s): ``python -m pytest -m gpu tests/system/test_gpu.py``, 150 s at most per test (JUnit XML
   beside its log);
5. ``gpu_train`` (120 s): ``python -m benchmarks.gpu_train --gpu-only`` (P7: our training images/s ÷ the torchvision
   reference recipe's, same GPU; goal >= 1.3), then ``rtdetr_v2_r18vd`` trained by our loop for 300 timed
   iterations with AMP bf16, its images/s printed beside the reference recipe's (issue 45);
6. ``nvjpeg`` (40 s): ``python -m benchmarks.nvjpeg`` (the loader's nvJPEG row: GPU decode ÷ CPU decode images/s);
7. ``augment_loader`` (60 s): ``python -m benchmarks.augment_loader --device cuda --augment-device cuda`` (issue 46
   item 4 on the GPU: loader images/s with each preset, augmented on the GPU, ÷ one ssdlite320 training step's).

``--only gpu_train,nvjpeg`` reruns some of steps 4-6 (after the three setup steps): a fixed step within the 15
minutes a GPU is lent. Without CUDA (the dry run on a CPU machine) every step is still reached: the GPU tests skip with their reason and
the benchmarks print one line saying there is no CUDA. A step that runs past its limit is killed with every
process it started (its own process group) and recorded as ``timeout``; the next step still runs.

Files in OUT_DIR (flat, at most 8 — what the device tool brings back): ``summary.json``, ``setup.log``
(install, versions, imports), ``pytest_gpu.log``, ``pytest_gpu.xml``, ``gpu_train.log``, ``nvjpeg.log``,
``augment_loader.log``.
Exit status 0 when no step failed or timed out, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LATER = ("pytest_gpu", "gpu_train", "nvjpeg", "augment_loader")  # the steps after install, versions and imports
BUNDLE = ROOT / ".gpu-bundle"

# Every module the GPU steps import, in this process or the ones they start (stage CLIs, torchrun workers).
MODULES = ["stages.convert", "stages.augment", "stages.train", "detpipe.engine.trainer", "detpipe.launch.jobs",
           "detpipe.launch.torchrun", "detpipe.data.dataset", "detpipe.data.convert", "detpipe.data.augment",
           "detpipe.evaluation.coco_metrics", "detpipe.models", "torch.distributed.run", "dvclive", "pytest",
           "pytest_timeout", "benchmarks.gpu_train", "benchmarks.nvjpeg", "benchmarks.augment_loader", "conftest",
           "support.pipeline", "support.procs", "transformers", "detpipe.models.transformers_family"]

VERSIONS = r"""
import json, platform, torch, torchvision
v = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
     "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    v.update(gpu=p.name, gpus=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
             gpu_memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
             nccl=".".join(map(str, torch.cuda.nccl.version())), bf16=torch.cuda.is_bf16_supported())
print(json.dumps(v))
"""


def _env(site: Path | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AWS_EC2_METADATA_DISABLED": "true", "DVC_NO_ANALYTICS": "1",
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    paths = [str(site)] if site else []
    paths += [str(ROOT), str(ROOT / "tests")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _step(name: str, cmd: list[str], limit: float, log, env: dict) -> dict:
    """Run ``cmd`` in its own process group with stdout+stderr appended to ``log``; kill the group at ``limit``
    seconds. Returns the step's record (status ``passed`` / ``failed`` / ``timeout``)."""
    log.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit:.0f} s)\n")
    log.flush()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: limit {limit:.0f} s", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(limit, 1))
        status = "passed" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc, status = proc.wait(), "timeout"
    finally:
        try:  # anything the step left behind in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    seconds = round(time.monotonic() - t0, 1)
    log.write(f"===== {name}: {status} (exit {rc}) in {seconds} s\n")
    log.flush()
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {status} (exit {rc}) in {seconds} s", flush=True)
    return {"name": name, "cmd": cmd, "limit_s": round(limit), "seconds": seconds, "rc": rc, "status": status}


def _tail_lines(path: Path, pattern: str) -> list[str]:
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if re.search(pattern, line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for the logs and summary.json (created)")
    ap.add_argument("--site", type=Path, default=Path("/tmp/detpipe-site"), help="where the bundle is installed")
    ap.add_argument("--budget", type=float, default=540, help="seconds for all steps together (9 minutes)")
    ap.add_argument("--only", default="", help="comma-separated steps after the setup ones to run (a rerun of a "
                    f"fixed step): any of {','.join(LATER)}; default all")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    left = lambda cap: min(cap, deadline - time.monotonic())  # noqa: E731
    py = sys.executable
    summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": py, "budget_s": args.budget,
                     "steps": []}
    steps = summary["steps"]

    with open(out / "setup.log", "w") as log:
        wheels = sorted(BUNDLE.glob("*.whl"))
        if not wheels:
            print(f"gpu_run: no wheels in {BUNDLE} (run `bash .ci/gpu_bundle.sh` and carry .gpu-bundle)", flush=True)
            return 1
        summary["bundle"] = {"wheels": [w.name for w in wheels], "bytes": sum(w.stat().st_size for w in wheels)}
        steps.append(_step("install", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                       "--no-cache-dir", "--upgrade", "--target", str(args.site), *map(str, wheels)],
                           left(45), log, _env(None)))
        env = _env(args.site)
        steps.append(_step("versions", [py, "-c", VERSIONS], left(45), log, env))
        if shutil.which("nvidia-smi"):
            steps.append(_step("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                              "--format=csv,noheader"], left(15), log, env))
        steps.append(_step("imports", [py, "-c", "import importlib, sys\nfor m in sys.argv[1:]:\n"
                                       "    importlib.import_module(m)\nprint('imported', len(sys.argv) - 1, "
                                       "'modules')", *MODULES], left(45), log, env))
    setup = (out / "setup.log").read_text(errors="replace")
    found = [json.loads(line) for line in setup.splitlines() if line.startswith('{"python"')]
    summary["versions"] = found[0] if found else None
    smi = re.search(r"===== nvidia_smi:.*\n(.+)\n", setup)
    if smi and summary["versions"] is not None:
        summary["versions"]["nvidia_smi"] = smi.group(1).strip()
    print(f"versions: {json.dumps(summary['versions'])}", flush=True)

    only = set(filter(None, args.only.split(","))) or set(LATER)
    if only - set(LATER):
        print(f"gpu_run: unknown step(s) {sorted(only - set(LATER))}; steps: {', '.join(LATER)}", flush=True)
        return 1
    later = {  # name: (command, limit in seconds, the log lines the summary keeps)
        "pytest_gpu": ([py, "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider", "--timeout", "150",
                        f"--junitxml={out / 'pytest_gpu.xml'}", "tests/system/test_gpu.py"], 330,
                       r"(PASSED|FAILED|SKIPPED|ERROR)|=+ .*(passed|failed|skipped|error).* =+$"),
        "gpu_train": ([py, "-m", "benchmarks.gpu_train", "--gpu-only", "--iters", "20", "--warmup", "5", "--rounds",
                       "2", "--ref-workers", "4", "--family-model", "rtdetr_v2_r18vd", "--family-iters", "300",
                       "--family-amp", "bf16"], 120,
                      r"^(ssdlite|round|reference recipe|family|ratio|gpu_train|device)"),
        "nvjpeg": ([py, "-m", "benchmarks.nvjpeg", "--batches", "20", "--rounds", "3"], 40,
                   r"^(NVIDIA|CPU decode|ratio|nvjpeg)"),
        "augment_loader": ([py, "-m", "benchmarks.augment_loader", "--device", "cuda", "--augment-device", "cuda",
                            "--min-seconds", "2", "--rounds", "1"], 60,
                           r"^(training step|flip|ssd|detr|yolo|ratio|augment_loader)"),
    }
    for name in LATER:
        if name not in only:
            continue
        cmd, limit, keep = later[name]
        with open(out / f"{name}.log", "w") as log:
            steps.append(_step(name, cmd, left(limit), log, env))
        summary[name] = _tail_lines(out / f"{name}.log", keep)

    summary["total_s"] = round(args.budget - (deadline - time.monotonic()), 1)
    summary["ok"] = all(s["status"] == "passed" for s in steps)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary.get(k) for k in ("total_s", "ok", *LATER)}, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
