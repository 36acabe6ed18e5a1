"""``python -m detpipe.launch.emit k8s``: the Kubeflow PyTorchJob's shared volume, GPU requests and refusals, the
manifest checked against the operator's CRD schema (tests/data/kubeflow, an excerpt of the upstream CRD), and the
Dockerfile / .dockerignore that build ``train.k8s_image``.

Nothing here talks to a Kubernetes API server or builds an image (neither exists on the test machines): the
manifest is validated with `jsonschema` against the CRD's openAPIV3Schema, plus a strict unknown-field check
(what ``kubectl apply --validate=strict`` does; plain JSON-schema validation of a CRD accepts unknown fields).
"""
from __future__ import annotations

import copy
import logging
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from detpipe.core.errors import StageError
from detpipe.launch import k8s
from detpipe.launch.emit import emit
from detpipe.params import Train
from support.pipeline import write_params
from support.procs import run

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "tests" / "data" / "kubeflow" / "kubeflow.org_pytorchjobs.excerpt.yaml"
PVC = "detpipe-shared"


def _job(**train) -> dict:
    """The PyTorchJob that `emit` writes for `Train` defaults + ``train``, parsed."""
    return yaml.safe_load(emit(Train(**train), "k8s"))


def _worker(job: dict) -> tuple[dict, dict]:
    """``(pod spec, the "pytorch" container)`` of the Worker replica."""
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


# ---- the CRD schema ------------------------------------------------------------------------------------------------

def _schema() -> dict:
    """The openAPIV3Schema of the vendored CRD's v1 version."""
    crd = yaml.safe_load(CRD.read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "kubeflow.org"
    assert crd["spec"]["names"]["kind"] == "PyTorchJob"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -2**31 <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -2**63 <= value < 2**63


def schema_errors(manifest: dict) -> list[str]:
    """What the CRD's schema rejects in ``manifest`` (OpenAPI v3 validated as JSON Schema draft 4, whose keywords
    it uses; ``int32``/``int64`` formats range-checked; ``x-kubernetes-*`` extensions are not JSON Schema and are
    ignored, ``x-kubernetes-int-or-string`` being spelled out as ``anyOf`` next to it)."""
    validator = jsonschema.Draft4Validator(_schema(), format_checker=_FORMATS)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Fields of ``value`` that ``schema`` does not declare, as the API server's strict field validation reports
    them (``kubectl apply --validate=strict``; without it they are silently pruned). An object schema with neither
    ``properties`` nor ``additionalProperties`` (``metadata``) accepts any field, as the API server does for it.
    Fields the excerpt omits count as unknown here: extend the excerpt from upstream when the manifest uses more."""
    found = []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                found += unknown_fields(item, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, f"{path}.{key}")
            elif props is not None:
                found.append(f"{path}.{key}".lstrip("."))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def test_the_vendored_schema_is_the_pytorchjob_crd():
    schema = _schema()
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["pytorchReplicaSpecs"]
    replica = spec["properties"]["pytorchReplicaSpecs"]["additionalProperties"]
    pod = replica["properties"]["template"]["properties"]["spec"]
    assert pod["required"] == ["containers"]
    assert pod["properties"]["containers"]["items"]["required"] == ["name"]
    assert pod["properties"]["volumes"]["items"]["properties"]["persistentVolumeClaim"]["required"] == ["claimName"]
    assert (REPO / "tests" / "data" / "kubeflow" / "LICENSE").read_text().lstrip().startswith("Apache License")


@pytest.mark.parametrize("train", [
    {},  # defaults: one CPU pod, no claim
    {"nnodes": "2:4", "nproc_per_node": 8, "k8s_pvc": PVC, "k8s_gpus": 8, "k8s_image": "registry.example/detpipe:1"},
    {"nnodes": "3", "k8s_pvc": PVC, "socket_ifname": "eth1", "rdzv_id": "Run_7.b"},
])
def test_the_manifest_is_valid_for_the_crd(train):
    job = _job(**train)
    assert schema_errors(job) == []
    assert unknown_fields(job, _schema()) == []
    # what the operator's admission webhook checks beyond the schema (pkg/webhooks/pytorch/pytorchjob_webhook.go):
    # a DNS-1035 name, a Worker replica with at least 1 replica, a non-empty image, a container named "pytorch"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] >= 1
    _, container = _worker(job)
    assert container["name"] == "pytorch" and container["image"]
    assert "nProcPerNode" not in job["spec"]["elasticPolicy"]  # deprecated since v1.7: a warning on apply


def _break(path: str, value=None, drop: bool = False):
    """A mutation of the manifest: set (or with ``drop`` delete) the item at the dotted ``path`` (list indexes as
    numbers)."""
    def apply(job: dict) -> dict:
        job = copy.deepcopy(job)
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = job
        for p in parents:
            node = node[p]
        if drop:
            del node[last]
        else:
            node[last] = value
        return job
    return apply


POD = "spec.pytorchReplicaSpecs.Worker.template.spec"
BROKEN = {
    "replicas as a word": _break("spec.pytorchReplicaSpecs.Worker.replicas", "two"),
    "replicas beyond int32": _break("spec.pytorchReplicaSpecs.Worker.replicas", 2**31),
    "elastic minReplicas a bool": _break("spec.elasticPolicy.minReplicas", True),
    "no pytorchReplicaSpecs": _break("spec.pytorchReplicaSpecs", drop=True),
    "no containers": _break(f"{POD}.containers", drop=True),
    "a container without a name": _break(f"{POD}.containers.0.name", drop=True),
    "command not a list": _break(f"{POD}.containers.0.command", "python -m torch.distributed.run"),
    "a mount without mountPath": _break(f"{POD}.containers.0.volumeMounts.0.mountPath", drop=True),
    "a claim without claimName": _break(f"{POD}.volumes.0.persistentVolumeClaim", {"readOnly": False}),
    "a GPU count that is no quantity": _break(f"{POD}.containers.0.resources.limits", {"nvidia.com/gpu": "one"}),
    "a port as a string": _break(f"{POD}.containers.0.ports.0.containerPort", "29400"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_manifest_is_rejected_by_the_schema(case):
    good = _job(nnodes="2", nproc_per_node=2, k8s_pvc=PVC, k8s_gpus=2)
    assert schema_errors(good) == []
    errors = schema_errors(BROKEN[case](good))
    assert errors, f"{case}: accepted"


def test_an_unknown_field_passes_the_schema_but_not_the_strict_check():
    """JSON-schema validation of a CRD does not reject a misspelt field (the API server prunes it: here the claim
    would silently not be mounted); the strict check does, naming it."""
    good = _job(nnodes="2", k8s_pvc=PVC)
    pod, container = _worker(good)
    typo = copy.deepcopy(good)
    _, c = _worker(typo)
    c["volumeMount"] = c.pop("volumeMounts")
    assert schema_errors(typo) == []
    assert unknown_fields(typo, _schema()) == [f"{POD}.containers[0].volumeMount"]
    assert unknown_fields(good, _schema()) == []


# ---- shared volume -------------------------------------------------------------------------------------------------

def test_the_claim_is_mounted_at_the_outputs_of_the_train_stage():
    job = _job(nnodes="2:4", k8s_pvc=PVC)
    pod, container = _worker(job)
    assert pod["volumes"] == [{"name": k8s.VOLUME, "persistentVolumeClaim": {"claimName": PVC}}]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"/workspace/checkpoints", "/workspace/models", "/workspace/dvclive"}
    for path, m in mounts.items():
        assert m["name"] == k8s.VOLUME and m["subPath"] == path.rsplit("/", 1)[1] and not m.get("readOnly")
    assert container["workingDir"] == k8s.WORKDIR == "/workspace"
    # the folders the train stage writes (detpipe.core.paths; dvc.yaml's outs) are the ones mounted
    from detpipe.core.paths import CKPT_DIR, LIVE_DIR, MODEL
    assert {CKPT_DIR.as_posix(), LIVE_DIR.as_posix(), MODEL.parent.as_posix()} == {m["subPath"] for m in mounts.values()}
    text = emit(Train(nnodes="2:4", k8s_pvc=PVC), "k8s")
    assert text.startswith("# Written by") and f"PersistentVolumeClaim {PVC}" in text.split("\n", 2)[1]


@pytest.mark.parametrize("nnodes", ["2", "1:3"])
def test_more_than_one_pod_without_a_claim_is_refused(nnodes):
    with pytest.raises(StageError, match=r"train\.k8s_pvc is null .* up to [23] pods.*ReadWriteMany"):
        emit(Train(nnodes=nnodes), "k8s")
    assert _job(nnodes=nnodes, k8s_pvc=PVC)  # the same with a claim is emitted


def test_one_pod_without_a_claim_is_emitted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="detpipe.launch.k8s"):
        text = emit(Train(nnodes="1"), "k8s")
    pod, container = _worker(yaml.safe_load(text))
    assert "volumes" not in pod and "volumeMounts" not in container
    assert "# WARNING: no train.k8s_pvc: checkpoints/, models/ and dvclive/ stay in the container" in text
    assert any("no train.k8s_pvc" in r.getMessage() for r in caplog.records)


def test_the_cli_refuses_and_emits(tmp_path):
    """``python -m detpipe.launch.emit k8s`` in a work dir: exit status 2 and one line naming train.k8s_pvc for
    two pods without a claim; with one, the manifest with the claim (written to --out)."""
    write_params(tmp_path, {"train": {"nnodes": 2}})
    refused = run([sys.executable, "-m", "detpipe.launch.emit", "k8s"], tmp_path, check=False, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert re.search(r"^error: .*train\.k8s_pvc", refused.stderr, re.M), refused.stderr
    write_params(tmp_path, {"train": {"nnodes": 2, "k8s_pvc": PVC, "k8s_gpus": 1}})
    run([sys.executable, "-m", "detpipe.launch.emit", "k8s", "--out", "train.yaml"], tmp_path, timeout=60)
    job = yaml.safe_load((tmp_path / "train.yaml").read_text())
    pod, container = _worker(job)
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == PVC
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert schema_errors(job) == [] and unknown_fields(job, _schema()) == []


# ---- GPUs ----------------------------------------------------------------------------------------------------------

def test_gpus_are_requested_per_pod_only_when_set():
    _, with_gpus = _worker(_job(nnodes="2", nproc_per_node=4, k8s_pvc=PVC, k8s_gpus=4))
    assert with_gpus["resources"] == {"limits": {"nvidia.com/gpu": 4}, "requests": {"nvidia.com/gpu": 4}}
    _, cpu = _worker(_job(nnodes="2", nproc_per_node=4, k8s_pvc=PVC))
    assert "resources" not in cpu


def test_more_workers_than_gpus_is_refused_fewer_warn(caplog):
    with pytest.raises(StageError, match=r"train\.nproc_per_node 4 > train\.k8s_gpus 2"):
        emit(Train(nproc_per_node=4, k8s_gpus=2), "k8s")
    with caplog.at_level(logging.WARNING, logger="detpipe.launch.k8s"):
        _, container = _worker(_job(nproc_per_node=2, k8s_gpus=4))
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert any("reserves 2 GPU(s) it does not use" in r.getMessage() for r in caplog.records)


# ---- the image -----------------------------------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile's text: comments dropped, ``\\`` continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, args = line.strip().partition(" ")
            out.append((word.upper(), args.strip()))
    return out


def pinned_python() -> str:
    """``"3.11"``: the Python that ``.ci/venv.sh`` builds the pinned requirements (requirements.txt) with, read
    from its version assert. Not ``sys.version_info``: the suite also runs on Python 3.12 (``.ci/compat.sh``, torch
    2.11 / torchvision 0.26), whose interpreter is not the image's, while the image installs requirements.txt."""
    (ver,) = re.findall(r"sys\.version_info\[:2\] == \((\d+), (\d+)\)", (REPO / ".ci" / "venv.sh").read_text())
    return ".".join(ver)


def dockerfile_problems(text: str) -> list[str]:
    """What the Dockerfile misses of what `k8s.pytorchjob` relies on: ``FROM`` the official ``python`` image at a
    tag of the Python that the pinned requirements are built for (`pinned_python`: ``3.11-slim``, a variant, or a
    digest), the pinned requirements installed from ``requirements.txt`` copied alone before the rest (the
    dependency layer is cached), the repository copied to ``WORKDIR`` `k8s.WORKDIR` (the manifest's
    workingDir)."""
    ins = dockerfile_instructions(text)
    words = [w for w, _ in ins]
    problems = []
    (base,) = [a for w, a in ins if w == "FROM"] or [""]
    py = pinned_python()
    if not re.fullmatch(rf"(docker\.io/(library/)?)?python:{re.escape(py)}(\.\d+)?-slim(-[a-z]+)?(@sha256:[0-9a-f]{{64}})?",
                        base):
        problems.append(f"FROM {base!r}: not python:{py}-slim")
    workdirs = [a for w, a in ins if w == "WORKDIR"]
    if workdirs != [k8s.WORKDIR]:
        problems.append(f"WORKDIR {workdirs}: not [{k8s.WORKDIR!r}]")
    copies = [(i, shlex.split(a)) for i, (w, a) in enumerate(ins) if w == "COPY"]
    installs = [i for i, (w, a) in enumerate(ins) if w == "RUN" and re.search(r"\bpip install\b.*-r requirements\.txt", a)]
    req = [i for i, args in copies if args[0] == "requirements.txt"]
    full = [i for i, args in copies if args[0] == "."]
    if not (req and installs and full and req[0] < installs[0] < full[0]):
        problems.append("not COPY requirements.txt, RUN pip install -r requirements.txt, then COPY . (in that order)")
    if "WORKDIR" in words and full and words.index("WORKDIR") > full[0]:
        problems.append("WORKDIR after COPY .")
    return problems


def test_the_dockerfile_builds_what_the_manifest_runs():
    assert dockerfile_problems((REPO / "Dockerfile").read_text()) == []
    assert pinned_python() == "3.11"  # the Python the FROM line must match (.ci/venv.sh's)


@pytest.mark.parametrize("edit", [
    ("FROM python:3.11-slim", "FROM python:latest"),
    ("FROM python:3.11-slim", "FROM ubuntu:24.04"),
    ("WORKDIR /workspace", "WORKDIR /app"),
    ("COPY requirements.txt ./", ""),
    ("RUN pip install --no-cache-dir -r requirements.txt", "RUN pip install torch"),
])
def test_a_broken_dockerfile_is_reported(edit):
    text = (REPO / "Dockerfile").read_text()
    assert edit[0] in text
    assert dockerfile_problems(text.replace(edit[0], edit[1])) != []


_GLOB = {re.escape("**/"): "(.*/)?", re.escape("**"): ".*", re.escape("*"): "[^/]*", re.escape("?"): "[^/]"}


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative, ``/``-separated) out of the build context under .dockerignore
    ``patterns``: the last matching pattern wins, ``!`` re-includes, a pattern matching a folder excludes what is
    in it (``*`` and ``?`` within one path element, ``**`` any number of folders: Docker's patterns without
    character classes)."""
    parts = path.split("/")
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = re.sub(r"\\\*\\\*/|\\\*\\\*|\\\*|\\\?", lambda m: _GLOB[m[0]], re.escape(pat.lstrip("!").strip("/")))
        if any(re.fullmatch(rx, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_the_dockerignore_keeps_what_the_pods_read():
    patterns = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
                if l.strip() and not l.lstrip().startswith("#")]
    for kept in ("params.yaml", "requirements.txt", "stages/train.py", "detpipe/launch/k8s.py",
                 "data/arrow/meta.json", "data/cache/train/shard-00000.bin", "models/.gitignore"):
        assert not dockerignored(kept, patterns), kept
    for left in (".git/HEAD", ".venv/bin/python", ".venv-compat312/bin/python", "checkpoints/ckpt-0000010.pt",
                 "models/model.pt", "dvclive/metrics.json", "data/arrow/train-0.parquet", ".dvc/config.local",
                 ".dvc/cache/ab/cd", "detpipe/launch/__pycache__/k8s.cpython-311.pyc", "logs/slurm-1.out"):
        assert dockerignored(left, patterns), left
    assert dockerignored("data/arrow/meta.json", patterns + ["data"])  # the matcher can say "excluded"


def test_the_docs_tag_the_image_the_params_name():
    """docs/multi-node.md's build command tags the image `train.k8s_image` names by default."""
    default = Train().k8s_image
    docs = (REPO / "docs" / "multi-node.md").read_text()
    assert f"docker build -t {default} ." in docs
    assert f"docker build -t {default} ." in (REPO / "Dockerfile").read_text()
