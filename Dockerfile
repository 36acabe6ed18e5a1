# The train stage's container image for Kubernetes (python -m stages.train --emit k8s; docs/multi-node.md#kubernetes).
# Build it in the repository after `dvc repro augment` and after setting params.yaml: the image holds both
# (params.yaml, data/arrow/meta.json and, unless train.cache_url is set, data/cache), and every pod reads them.
#   docker build -t detpipe:latest .                                          # train.k8s_image's default
#   docker build -t REGISTRY/detpipe:TAG . && docker push REGISTRY/detpipe:TAG   # then set train.k8s_image
#
# The Python of .ci/venv.sh (3.11). For a reproducible base, pin its digest: python:3.11-slim@sha256:<digest>.
FROM python:3.11-slim

# Analytics off (DVCLive / DVC, Prefect and others honouring DO_NOT_TRACK); logs unbuffered; no .pyc in the image.
ENV DVC_NO_ANALYTICS=1 \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /workspace

# The pinned environment, in its own layer (rebuilt only when requirements.txt changes). torch and torchvision come
# from PyPI, whose Linux x86_64 torch wheel is the CUDA build: requirements.txt pins the CUDA runtime wheels it
# depends on (nvidia-*-cu13, cuda-toolkit: CUDA 13.0), so no extra package index is needed; the nodes need an
# NVIDIA driver recent enough for CUDA 13.0 (and NVIDIA's device plugin for train.k8s_gpus). A CPU-only or other-CUDA
# image would install torch/torchvision from one of PyTorch's own wheel indexes (pip --index-url) instead of these
# pins: not done here.
COPY requirements.txt ./
RUN pip install --no-cache-dir -r requirements.txt

# The repository (see .dockerignore for what stays out). The process runs as root: the kubelet creates the
# PersistentVolumeClaim's subPath folders (checkpoints/, models/, dvclive/) owned by root, so a non-root worker
# could not write into them on a fresh claim (kubernetes/kubernetes#41638).
COPY . .

# The PyTorchJob sets the command (torchrun); this default only shows the stage's options.
CMD ["python", "-m", "stages.train", "--help"]
