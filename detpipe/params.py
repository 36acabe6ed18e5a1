"""Load and validate ``params.yaml``: one flat section per stage, unknown keys and wrong types are errors.

Each stage reads only its own section (``load("train")``); ``dvc.yaml`` lists exactly those keys so DVC's
cache is exact.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from detpipe.errors import StageError

PARAMS_FILE = Path("params.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Download(_Section):
    source: str
    sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    retries: int = Field(default=3, ge=0)
    timeout_s: float = Field(default=60, gt=0)
    endpoint_url: Optional[str] = None


class Convert(_Section):
    annotations: str
    images: str
    val_annotations: Optional[str] = None
    val_images: Optional[str] = None
    val_fraction: float = Field(default=0.2, ge=0, lt=1)
    seed: int = 0
    shard_mb: float = Field(default=64, gt=0)
    strict: bool = False
    workers: int = Field(default=2, ge=0)


class Augment(_Section):
    resize: Literal["fixed", "keep_ratio"] = "fixed"
    size: int = Field(default=320, gt=0)
    min_size: int = Field(default=800, gt=0)
    max_size: int = Field(default=1333, gt=0)
    copies: int = Field(default=0, ge=0)
    seed: int = 0
    workers: int = Field(default=2, ge=0)


class Train(_Section):
    model: str = "ssdlite320_mobilenet_v3_large"
    weights: Optional[str] = None
    weights_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    nproc_per_node: int = Field(default=1, ge=1)
    nnodes: int = Field(default=1, ge=1)
    node_rank: int = Field(default=0, ge=0)
    rdzv_endpoint: str = Field(default="127.0.0.1:29500", pattern=r"^[^:\s]+:\d+$")
    epochs: int = Field(default=8, ge=1)
    batch_size: int = Field(default=16, ge=1)
    accumulate: int = Field(default=1, ge=1)
    base_batch_size: Optional[int] = Field(default=None, ge=1)
    lr: float = Field(default=0.05, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=4e-5, ge=0)
    schedule: Literal["cosine", "multistep"] = "cosine"
    milestones: list[float] = Field(default_factory=lambda: [0.67, 0.89])
    gamma: float = Field(default=0.1, gt=0, le=1)
    warmup_iters: int = Field(default=10, ge=0)
    hflip: float = Field(default=0.5, ge=0, le=1)
    seed: int = 0
    num_workers: int = Field(default=0, ge=0)
    checkpoint_every: int = Field(default=20, ge=1)
    keep_last: int = Field(default=2, ge=1)
    resume: Literal["auto", "never", "must"] = "auto"
    amp: Literal["off", "bf16", "fp16"] = "off"
    max_bad_steps: int = Field(default=5, ge=0)
    threads: int = Field(default=0, ge=0)
    deterministic: bool = False
    channels_last: bool = False
    compile: bool = False
    ema: bool = False
    ema_decay: float = Field(default=0.9998, gt=0, lt=1)
    eval_every: int = Field(default=0, ge=0)
    log_every: int = Field(default=1, ge=1)
    cache_url: Optional[str] = None

    @field_validator("amp", mode="before")
    @classmethod
    def _amp_off(cls, v):
        # YAML 1.1 (PyYAML) reads an unquoted `off` as False; DVC's `-S` rewrites params.yaml unquoted.
        return "off" if v is False else v

    @model_validator(mode="after")
    def _check(self):
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank {self.node_rank} must be < train.nnodes {self.nnodes}")
        if any(not 0 < m < 1 for m in self.milestones) or self.milestones != sorted(self.milestones):
            raise ValueError("train.milestones must be increasing fractions of training in (0, 1)")
        return self


class Evaluate(_Section):
    batch_size: int = Field(default=16, ge=1)
    backend: Literal["pycocotools", "faster_coco_eval"] = "pycocotools"
    score_threshold: float = Field(default=0.0, ge=0, le=1)
    nproc_per_node: int = Field(default=1, ge=1)
    num_plot_images: int = Field(default=4, ge=0)
    plot_score_threshold: float = Field(default=0.3, ge=0, le=1)


class Export(_Section):
    opset: int = Field(default=17, ge=11)
    num_images: int = Field(default=4, ge=1)
    score_threshold: float = Field(default=0.05, ge=0, le=1)
    iou_match: float = Field(default=0.99, gt=0, le=1)
    min_match: float = Field(default=0.99, ge=0, le=1)


class Flows(_Section):
    retries: int = Field(default=1, ge=0)
    retry_delay_s: float = Field(default=10, ge=0)


class Params(_Section):
    download: Download
    convert: Convert
    augment: Augment
    train: Train
    evaluate: Evaluate
    export: Export
    flows: Flows


def load(section: str | None = None, path: Path | str = PARAMS_FILE):
    """Read and validate the params file; return one section (e.g. ``"train"``) or the whole `Params`.

    Raises:
        StageError: the file is missing, is not YAML, or breaks the schema (the message names the key).
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path}: file not found (run from the repository root)") from None
    except yaml.YAMLError as e:
        raise StageError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        params = Params.model_validate(raw or {})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise StageError(f"{path}: key '{key}': {err['msg']} (got {err.get('input')!r})") from None
    return getattr(params, section) if section else params
