"""Kubernetes: a Kubeflow Training Operator ``PyTorchJob`` (``kubeflow.org/v1``) that runs the train stage with the
same torchrun arguments as a local launch.

One Worker pod per node (``train.nnodes``: MIN..MAX replicas through ``elasticPolicy``); each pod's container
runs ``python -m detpipe.launch.torchrun <args> -m stages.train`` (torchrun's agent completed on the node: its
rendezvous host decision and address, `detpipe.launch.torchrun_args.node_args`) in `WORKDIR` (the repository inside
``train.k8s_image``, built from the repository's Dockerfile) with the c10d rendezvous on pod ``<job>-worker-0``
(the operator gives every replica a DNS name) at the port of ``train.rdzv_endpoint`` and the job name as
rendezvous id. The operator recreates failed pods (``restartPolicy: OnFailure``); torchrun restarts the worker
group; every start resumes from the newest checkpoint, so ``checkpoints/`` must be on a volume all pods share:
the PersistentVolumeClaim ``train.k8s_pvc`` (ReadWriteMany), mounted in every pod at ``checkpoints/``,
``models/`` and ``dvclive/`` of `WORKDIR` (subPaths of the same names: rank 0, on whichever pod it runs, writes
all three, and they outlive the pods). ``train.k8s_gpus`` > 0 asks for that many ``nvidia.com/gpu`` per pod.
See docs/multi-node.md#kubernetes.
"""
from __future__ import annotations

import hashlib
import json
import logging

import yaml

from detpipe.core.errors import StageError
from detpipe.launch.torchrun_args import AGENT_MODULE, parse_nnodes
from detpipe.core.paths import CKPT_DIR, LIVE_DIR, MODELS_DIR

log = logging.getLogger("detpipe.launch.k8s")

WORKDIR = "/workspace"  # where the image holds the repository (the Dockerfile's WORKDIR)
SHARED_DIRS = (CKPT_DIR.as_posix(), MODELS_DIR.as_posix(), LIVE_DIR.as_posix())
"""The train stage's outputs (detpipe.core.paths), each mounted from the subPath of the same name of ``train.k8s_pvc``."""
VOLUME = "shared"  # the pod's name for the claim's volume
GPU_RESOURCE = "nvidia.com/gpu"  # the extended resource of NVIDIA's Kubernetes device plugin


def job_name(cfg) -> str:
    """``train.rdzv_id`` lower-cased, else ``detpipe-train-`` + 8 hex of the params' sha256 (a DNS-1035 label,
    the same for the same params)."""
    if cfg.rdzv_id:
        return cfg.rdzv_id.lower().replace("_", "-").replace(".", "-")[:50]
    return "detpipe-train-" + hashlib.sha256(json.dumps(cfg.model_dump(), sort_keys=True).encode()).hexdigest()[:8]


def rdzv_endpoint(job: str, cfg=None) -> str:
    """``<job>-worker-0:<port>``: the first Worker pod's service name and ``train.rdzv_endpoint``'s port."""
    port = cfg.rdzv_endpoint.rsplit(":", 1)[1] if cfg is not None else "29400"
    return f"{job}-worker-0:{port}"


def check_k8s(cfg) -> None:
    """Refuse params whose manifest could not work as a multi-pod job; warn about wasteful ones.

    Args:
        cfg: `detpipe.params.Train` (nnodes, nproc_per_node, k8s_pvc, k8s_gpus).
    Raises:
        StageError: ``train.k8s_pvc`` is null while MAX of ``train.nnodes`` is > 1 (without a shared volume each
            pod writes its own checkpoints/, and a recreated pod starts over instead of resuming);
            ``train.k8s_gpus`` > 0 but below ``train.nproc_per_node`` (NCCL needs one GPU per worker process).
    Logs a warning when ``k8s_gpus`` > ``nproc_per_node`` (GPUs reserved and left idle).
    """
    _, hi = parse_nnodes(cfg.nnodes)
    if cfg.k8s_pvc is None and hi > 1:
        raise StageError(f"params.yaml: train.k8s_pvc is null but train.nnodes {cfg.nnodes!r} runs up to {hi} pods: "
                         "set train.k8s_pvc to a ReadWriteMany PersistentVolumeClaim (checkpoints/ must be shared, "
                         "or a restarted pod starts over)")
    if cfg.k8s_gpus and cfg.nproc_per_node > cfg.k8s_gpus:
        raise StageError(f"params.yaml: train.nproc_per_node {cfg.nproc_per_node} > train.k8s_gpus {cfg.k8s_gpus}: "
                         "one worker process per GPU (set train.k8s_gpus to train.nproc_per_node)")
    if cfg.k8s_gpus > cfg.nproc_per_node:
        log.warning("train.k8s_gpus %d > train.nproc_per_node %d: each pod reserves %d GPU(s) it does not use",
                    cfg.k8s_gpus, cfg.nproc_per_node, cfg.k8s_gpus - cfg.nproc_per_node)


def shared_volume(pvc: str) -> tuple[dict, list[dict]]:
    """The pod's volume for the PersistentVolumeClaim ``pvc`` and the container's mounts of it: `SHARED_DIRS`,
    each the claim's subPath of that name at ``WORKDIR/<name>`` (the kubelet creates a missing subPath).

    Returns:
        ``(volume, volume_mounts)``: a ``spec.volumes`` item and ``containers[].volumeMounts`` items.
    """
    volume = {"name": VOLUME, "persistentVolumeClaim": {"claimName": pvc}}
    mounts = [{"name": VOLUME, "mountPath": f"{WORKDIR}/{d}", "subPath": d} for d in SHARED_DIRS]
    return volume, mounts


def gpu_resources(gpus: int) -> dict | None:
    """``containers[].resources`` asking for ``gpus`` `GPU_RESOURCE` (limits and requests equal: an extended
    resource cannot be overcommitted), or None for 0 (CPU pods)."""
    if not gpus:
        return None
    return {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}}


def pytorchjob(cfg, job: str, torchrun_argv: list[str], env: dict[str, str]) -> dict:
    """The PyTorchJob as a dict (see `pytorchjob_manifest`). Raises `StageError` as `check_k8s`."""
    check_k8s(cfg)
    lo, hi = parse_nnodes(cfg.nnodes)
    container = {
        "name": "pytorch",  # the operator expects this container name
        "image": cfg.k8s_image,
        "workingDir": WORKDIR,
        "command": ["python", "-m", AGENT_MODULE, *torchrun_argv],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "c10d", "containerPort": int(torchrun_argv[torchrun_argv.index("--rdzv-endpoint") + 1]
                                                        .rsplit(":", 1)[1])}],
    }
    pod: dict = {"containers": [container]}
    if cfg.k8s_pvc:
        volume, container["volumeMounts"] = shared_volume(cfg.k8s_pvc)
        pod["volumes"] = [volume]
    resources = gpu_resources(cfg.k8s_gpus)
    if resources:
        container["resources"] = resources
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job, "labels": {"app.kubernetes.io/name": "detpipe-train"}},
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": lo, "maxReplicas": hi,
                              "maxRestarts": cfg.max_restarts},
            "nprocPerNode": str(cfg.nproc_per_node),  # (elasticPolicy.nProcPerNode is deprecated since v1.7)
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": hi, "restartPolicy": "OnFailure",
                "template": {"spec": pod},
            }},
        },
    }


def pytorchjob_manifest(cfg, job: str, torchrun_argv: list[str], env: dict[str, str]) -> str:
    """The PyTorchJob as YAML text, with a comment header (what wrote it; where outputs go).

    Args:
        cfg: `detpipe.params.Train` (nnodes, nproc_per_node, max_restarts, k8s_image, k8s_pvc, k8s_gpus).
        job: metadata.name (also the rendezvous id in ``torchrun_argv``).
        torchrun_argv: torchrun's arguments (`detpipe.launch.torchrun_args.torchrun_args` with `rdzv_endpoint`).
        env: the workers' environment (`detpipe.launch.torchrun_args.launch_env`).
    Raises:
        StageError: as `check_k8s` (no ``train.k8s_pvc`` for more than one pod; fewer GPUs than workers).
    """
    manifest = pytorchjob(cfg, job, torchrun_argv, env)
    head = "# Written by `python -m detpipe.launch.emit k8s` (docs/multi-node.md).\n"
    if cfg.k8s_pvc:
        head += (f"# checkpoints/, models/ and dvclive/ are on PersistentVolumeClaim {cfg.k8s_pvc} (subPaths of the "
                 "same names).\n")
    else:
        warning = ("no train.k8s_pvc: checkpoints/, models/ and dvclive/ stay in the container and are lost with it "
                   "(a restarted container starts over)")
        log.warning("%s", warning)
        head += f"# WARNING: {warning}.\n"
    return head + yaml.safe_dump(manifest, sort_keys=False)
