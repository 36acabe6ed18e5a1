"""Kubernetes: a Kubeflow Training Operator ``PyTorchJob`` (``kubeflow.org/v1``) that runs the train stage with the
same torchrun arguments as a local launch.

One Worker pod per node (``train.nnodes``: MIN..MAX replicas through ``elasticPolicy``); each pod's container
runs ``python -m torch.distributed.run <args> -m stages.train`` with the c10d rendezvous on pod
``<job>-worker-0`` (the operator gives every replica a DNS name) at the port of ``train.rdzv_endpoint`` and the
job name as rendezvous id. The operator recreates failed pods (``restartPolicy: OnFailure``); torchrun restarts
the worker group; every start resumes from the newest checkpoint, so ``checkpoints/`` must be on a volume all
pods share (a ReadWriteMany PVC mounted at the working directory, see docs/multi-node.md).
"""
from __future__ import annotations

import hashlib
import json

import yaml

from detpipe.launch.torchrun import parse_nnodes

WORKDIR = "/workspace"  # where the image holds the repository (and the shared volume is mounted)


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


def pytorchjob_manifest(cfg, job: str, torchrun_argv: list[str], env: dict[str, str]) -> str:
    """The PyTorchJob as YAML text.

    Args:
        cfg: `detpipe.params.Train` (nnodes, nproc_per_node, max_restarts, k8s_image).
        job: metadata.name (also the rendezvous id in ``torchrun_argv``).
        torchrun_argv: torchrun's arguments (`detpipe.launch.torchrun.torchrun_args` with `rdzv_endpoint`).
        env: the workers' environment (`detpipe.launch.torchrun.launch_env`).
    """
    lo, hi = parse_nnodes(cfg.nnodes)
    container = {
        "name": "pytorch",  # the operator expects this container name
        "image": cfg.k8s_image,
        "workingDir": WORKDIR,
        "command": ["python", "-m", "torch.distributed.run", *torchrun_argv],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "c10d", "containerPort": int(torchrun_argv[torchrun_argv.index("--rdzv-endpoint") + 1]
                                                        .rsplit(":", 1)[1])}],
    }
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job, "labels": {"app.kubernetes.io/name": "detpipe-train"}},
        "spec": {
            "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": lo, "maxReplicas": hi,
                              "maxRestarts": cfg.max_restarts, "nProcPerNode": cfg.nproc_per_node},
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": hi, "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [container]}},
            }},
        },
    }
    return "# Written by `python -m stages.train --emit k8s` (docs/multi-node.md).\n" + \
        yaml.safe_dump(manifest, sort_keys=False)
