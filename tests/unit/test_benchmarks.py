"""`benchmarks.models` (issue 45.6): its command line, its ratio line's definition and its reading of the train
stage's own log. The benchmark itself (minutes of training per model) is never run by the suite: its figures are
in docs/benchmarks.md."""
import json
import math
import subprocess
import sys

import yaml

from benchmarks.models import MODELS, ratio, step_rate
from support.procs import REPO


def test_models_benchmark_help_names_the_budget_and_the_default_models():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.models", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--epochs" in proc.stdout and "--threads" in proc.stdout
    assert MODELS == ["ssdlite320_mobilenet_v3_large", "dfine_n", "dfine_s", "rtdetr_v2_r18vd"]


def test_ratio_is_best_new_ap_over_the_baseline_and_defined_when_the_baseline_is_zero():
    base = "ssdlite320_mobilenet_v3_large"
    assert ratio({base: 0.02, "dfine_n": 0.01, "rtdetr_v2_r18vd": 0.03}, base) == ("rtdetr_v2_r18vd", 1.5)
    assert ratio({base: 0.02, "dfine_n": 0.0}, base) == ("dfine_n", 0.0)
    assert ratio({base: 0.0, "dfine_n": 0.001, "dfine_s": 0.0}, base) == ("dfine_n", math.inf)
    best, r = ratio({base: 0.0, "dfine_n": 0.0}, base)
    assert best == "dfine_n" and math.isnan(r)
    assert ratio({base: 0.5}, base) == (base, 1.0)


def test_step_rate_reads_every_iteration_of_the_train_stage_log(trained_workdir):
    params = yaml.safe_load((trained_workdir / "params.yaml").read_text())["train"]
    train_rows = json.loads((trained_workdir / "data/cache/meta.json").read_text())["splits"]["train"]["rows"]
    rate, iters = step_rate(trained_workdir, params["batch_size"])
    assert iters == params["epochs"] * (train_rows // params["batch_size"])     # the trainer drops a partial batch
    assert math.isfinite(rate) and rate > 0
