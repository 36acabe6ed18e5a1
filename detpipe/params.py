"""Load and validate ``params.yaml``: one flat section per stage, unknown keys and wrong types are errors.

Each stage reads only its own section (``load("train")``); ``dvc.yaml`` lists exactly those keys so DVC's
cache is exact.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator

from detpipe.core.errors import StageError

PARAMS_FILE = Path("params.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


SHA256_PATTERN = r"^[0-9a-f]{64}$"


class DownloadPart(_Section):
    """One part of a dataset that comes in several (``download.source`` as a list)."""

    url: str = Field(description="Local path or fsspec URL of this part: a folder, a .zip/.tar[.gz|.bz2|.xz] archive (extracted into data/raw beside the other parts) or one file.")
    sha256: Optional[str] = Field(default=None, pattern=SHA256_PATTERN, description="Hex sha256 of this part as fetched (the archive or file bytes, or a folder's manifest: python -m stages.download --print-sha256 URL); null skips the check.")


# The JSON schema of download.source written out inline: the Prefect deployment's ``overrides`` schema takes each
# key's schema on its own (`detpipe.orchestration.overrides.json_schema`), where a $ref to DownloadPart would dangle.
_SOURCE_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "string"},
        {"type": "object", "additionalProperties": False, "required": ["url"], "properties": {
            "url": {"type": "string"},
            "sha256": {"anyOf": [{"type": "string", "pattern": SHA256_PATTERN}, {"type": "null"}]}}}]}}]}


class Download(_Section):
    source: Annotated[Union[str, list[DownloadPart]], WithJsonSchema(_SOURCE_SCHEMA)] = Field(description='Local path or fsspec URL (folder, .zip/.tar[.gz|.bz2|.xz] archive, or one file) copied into data/raw; or a list of parts, each {url, sha256} (a plain string item is {url: item, sha256: null}), all fetched, checked and merged into the one data/raw (a path two parts hold with different bytes is an error).')
    sha256: Optional[str] = Field(default=None, pattern=SHA256_PATTERN, description="Hex sha256 of the fetched file, or of a folder's manifest (python -m stages.download --print-sha256); null skips the check. Must be null when source is a list (each part has its own).")
    retries: int = Field(default=3, ge=0, description='Retries of transient network errors (connection, timeouts, 408/425/429/5xx), exponential backoff 1 s .. 60 s.')
    timeout_s: float = Field(default=60, gt=0, description='Seconds a connect or read may stall before it counts as a transient error.')
    endpoint_url: Optional[str] = Field(default=None, description='S3-compatible endpoint (SeaweedFS, MinIO) for s3:// sources; credentials only from the environment / AWS config.')
    max_extract_bytes: int = Field(default=64 * 10**9, gt=0, description='Largest size an archive (each part\'s, with a list) may extract to, in bytes (its entries\' declared sizes; also never more than the free disk space).')
    max_compression_ratio: float = Field(default=200, gt=0, description='Largest extracted size / archive size; beyond it the archive is refused as a likely zip bomb.')

    @field_validator("source", mode="before")
    @classmethod
    def _parts(cls, v):
        """A list: each item validated as a `DownloadPart` (a string is its url), errors naming the part's index
        (0-based) and key, rather than the union's two alternatives."""
        if not isinstance(v, list):
            return v
        parts = []
        for i, item in enumerate(v):
            try:
                parts.append(DownloadPart.model_validate({"url": item} if isinstance(item, str) else item))
            except ValidationError as e:
                err = e.errors()[0]
                key = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"part {i}: {key + ': ' if key else ''}{err['msg']} (got {err.get('input')!r})") \
                    from None
        return parts

    @model_validator(mode="after")
    def _one_hash_per_part(self):
        if isinstance(self.source, list):
            if not self.source:
                raise ValueError("source: an empty list names no data; give a path/URL or at least one part")
            if self.sha256 is not None:
                raise ValueError("sha256 must be null when source is a list: give each part its own sha256")
            urls = [p.url for p in self.source]
            repeated = sorted({u for u in urls if urls.count(u) > 1})
            if repeated:
                raise ValueError(f"source lists the same part twice: {repeated[0]}")
        return self

    @property
    def parts(self) -> list[DownloadPart]:
        """The sources as a list: one part ``{source, sha256}`` for the single-string form."""
        if isinstance(self.source, str):
            return [DownloadPart(url=self.source, sha256=self.sha256)]
        return list(self.source)


class Convert(_Section):
    format: Literal["coco", "yolo", "voc", "labelme", "cvat", "auto"] = Field(default="coco", description="Dataset format in data/raw (docs/convert.md): coco (annotations + images), yolo (data.yaml with names, train, val; Ultralytics layout), voc (Pascal VOC: Annotations/*.xml, JPEGImages/, optional ImageSets/Main/{train,val,trainval}.txt), labelme (one LabelMe JSON per image; train/ and val/ folders or val_fraction), cvat (annotations.xml, CVAT for images 1.1, images under images/). auto: the format whose marker is found (yolo: a data.yaml with names; voc: Annotations/*.xml beside JPEGImages/; labelme: a JSON with shapes and imagePath; cvat: annotations.xml; coco: the annotations JSON); several or none is an error.")
    annotations: Optional[str] = Field(default=None, description='COCO instances JSON, relative to data/raw (required for format coco; auto looks for it; other formats ignore it).')
    images: Optional[str] = Field(default=None, description='Image folder of that JSON, relative to data/raw (required for format coco).')
    val_annotations: Optional[str] = Field(default=None, description='Separate val/test JSON relative to data/raw (its own image-id space); null = split the train file by val_fraction.')
    val_images: Optional[str] = Field(default=None, description='Image folder of val_annotations (default: images).')
    val_fraction: float = Field(default=0.2, ge=0, lt=1, description='Share of images (by sorted id, permuted with seed) that go to val when there is no val file.')
    seed: int = Field(default=0, description='Seed of the train/val permutation (numpy.random.default_rng).')
    shard_mb: float = Field(default=64, gt=0, description='Image bytes per Arrow shard, in MB (10^6 bytes).')
    strict: bool = Field(default=False, description='Turn every counted validation rule into an error naming the file, record and rule.')
    workers: int = Field(default=2, ge=0, description='Processes that read, validate and write shards (0 = in this process).')
    leaks: Literal["off", "report", "drop", "error"] = Field(default="report", description="Near-duplicate check of val against train (rule val_near_duplicate): each val image's perceptual hash (ImageHash pHash, 64 bit, of the whole frame and of its central 90 %) is compared with every kept train image's; one within leak_distance is listed in report.json and kept (report), dropped from val with its annotations (drop) or an error naming both files (error); off: no hashing. Byte copies are always dropped (val_image_in_train).")
    leak_distance: int = Field(default=10, ge=0, le=64, description="Largest pHash Hamming distance (bits of 64) at which a val image counts as a near-duplicate of a train image (leaks). 10: on COCO128 re-encoded (JPEG q70), resized (x0.9) and 5 %-per-side cropped copies lie 0-8 bits from their original, distinct images at least 16 apart (docs/convert.md).")

    @model_validator(mode="after")
    def _coco_needs_its_files(self):
        if self.format == "coco" and (self.annotations is None or self.images is None):
            raise ValueError("format coco needs annotations (the COCO JSON) and images (its image folder)")
        return self


class Augment(_Section):
    resize: Literal["fixed", "keep_ratio"] = Field(default="fixed", description="fixed: size x size (SSD); keep_ratio: torchvision's R-CNN rule (shorter side min_size, longer <= max_size).")
    size: int = Field(default=320, gt=0, description='Side in pixels for resize: fixed.')
    min_size: int = Field(default=800, gt=0, description='keep_ratio: target shorter side in pixels.')
    max_size: int = Field(default=1333, gt=0, description='keep_ratio: cap of the longer side in pixels.')
    copies: int = Field(default=0, ge=0, description='SSD-style augmented copies per train image (photometric, zoom-out, IoU crop), stored beside the original.')
    seed: int = Field(default=0, description='Seed of the augmented copies (one stream per image and copy).')
    workers: int = Field(default=2, ge=0, description='Processes that decode and resize (0 = in this process); does not change the output.')
    encoding: Literal["raw", "jpeg"] = Field(default="jpeg", description='Stored pixels: raw (uint8 CHW, no decode at load time) or jpeg (torchvision.io.encode_jpeg; decoded at load time with decode_jpeg, batched, on the GPU when training on CUDA).')
    jpeg_quality: int = Field(default=90, ge=1, le=100, description='JPEG quality (1-100) of encoding: jpeg.')
    upscale: bool = Field(default=True, description='keep_ratio: store images the rule would enlarge at their original size instead (false; the model transform enlarges them per step), which keeps a jpeg cache below the source size at 800/1333.')
    shard_mb: float = Field(default=32, gt=0, description='Stored image bytes per cache shard, in MB (10^6 bytes); tens of MB suit streaming whole shards from object storage.')


TrainRole = Literal["result", "schedule", "run", "launch"]
"""What a `Train` field changes (`train_keys`)."""

_LAUNCH = {"role": "launch"}
"""Role of the `Train` fields that only say how the job is launched (torchrun, rendezvous, Slurm, Kubernetes, the
collective timeout, the network interface): they change neither what is trained nor its result, so a checkpoint made
with other values resumes (`detpipe.engine.checkpoints.fingerprint` leaves them out)."""
_SCHEDULE = {"role": "schedule"}
"""Role of the `Train` fields that only change the *schedule* of a training, not which training it is: a checkpoint
made with other values of these is continued by ``train.resume: auto`` (model, optimizer, scaler, EMA, sampler and RNG
state kept; the lr from the checkpoint's iteration on follows the plan for the new values:
`detpipe.engine.hooks.lr_factor` over the new total)."""
_RUN = {"role": "run"}
"""Role of the `Train` fields that say how this run goes (resume policy, checkpoint cadence, loaders, threads,
logging, where the cache is read from, evaluations) without changing the trained weights' training: left out of the
checkpoint fingerprint."""


class Train(_Section):
    model: str = Field(default="ssdlite320_mobilenet_v3_large", description='Detector name: a torchvision detection builder (torchvision.models.list_models(torchvision.models.detection)) or a transformers-family name (rtdetr_v2_r18vd, rtdetr_v2_r34vd, rtdetr_v2_r50vd_m, rtdetr_v2_r50vd, rtdetr_v2_r101vd, dfine_n, dfine_s, dfine_m; rtdetr_v2_tiny / dfine_tiny are small CPU-test configs), docs/train.md "Model families".')
    weights: Optional[str] = Field(default=None, description='Initial state_dict: local path or http(s):// / s3:// URL, a torchvision weights name (online only); for RT-DETRv2/D-FINE also a Hugging Face model folder (config.json + model.safetensors), a .safetensors file or a hub id (online only); exp:<experiment, branch or tag> (its models/model.pt; needs weights_sha256), checkpoint:best or checkpoint:last; null = random init.')
    weights_sha256: Optional[str] = Field(default=None, pattern=r"^[0-9a-f]{64}$", description='Hex sha256 the weights file must have (a Hugging Face folder: its manifest digest, python -m stages.download --print-sha256; required for exp:<name>: the pin dvc.lock records); null skips the check.')
    nproc_per_node: int = Field(default=1, ge=1, description='Worker processes per node (one per GPU on CUDA).')
    nnodes: str = Field(json_schema_extra=_LAUNCH, default="1", pattern=r"^[1-9]\d*(:[1-9]\d*)?$", description='Nodes of the job: N, or MIN:MAX for an elastic job that goes on with as few as MIN nodes (torchrun --nnodes).')
    rdzv_endpoint: str = Field(json_schema_extra=_LAUNCH, default="127.0.0.1:29400", pattern=r"^[^:\s]+:\d+$", description='host:port of the c10d rendezvous store when the job has more than one node: a node every node reaches (the first node under Slurm); one node uses a free port on 127.0.0.1.')
    epochs: int = Field(json_schema_extra=_SCHEDULE, default=8, ge=1, description='Passes over the train split.')
    batch_size: int = Field(default=16, ge=1, description='Images per process per micro-batch.')
    accumulate: int = Field(default=1, ge=1, description='Micro-batches per optimizer step (gradient accumulation).')
    base_batch_size: Optional[int] = Field(json_schema_extra=_SCHEDULE, default=None, ge=1, description='If set, lr is scaled by total batch / base_batch_size (linear scaling rule, Goyal et al. 2017).')
    lr: float = Field(json_schema_extra=_SCHEDULE, default=0.05, gt=0, description='Peak learning rate of the optimizer (before scaling): 0.05 suits SGD, 0.0001 AdamW (train.optimizer).')
    optimizer: Literal["auto", "sgd", "adamw"] = Field(default="auto", description="Optimizer: auto (the model family's recipe: sgd for torchvision's models, adamw for the transformers family's RT-DETRv2 / D-FINE), sgd (torch SGD with momentum) or adamw (torch AdamW, betas 0.9/0.999; weight decay exempt for 1-D parameters: norms and biases; needs train.lr <= 0.01, 0.0001 is the papers').")
    backbone_lr_mult: Optional[float] = Field(default=None, ge=0, description="The backbone's learning rate = lr x this factor; null = the family's (1.0 torchvision, 0.1 transformers as RT-DETR/D-FINE).")
    momentum: float = Field(default=0.9, ge=0, lt=1, description='SGD momentum.')
    weight_decay: float = Field(json_schema_extra=_SCHEDULE, default=4e-5, ge=0, description='Weight decay: SGD L2 on every parameter; AdamW decoupled, on parameters of 2+ dimensions only (train.optimizer).')
    schedule: Literal["cosine", "multistep"] = Field(json_schema_extra=_SCHEDULE, default="cosine", description='LR schedule after linear warmup, per iteration: cosine or multistep.')
    milestones: list[float] = Field(json_schema_extra=_SCHEDULE, default_factory=lambda: [0.67, 0.89], description='multistep: increasing fractions of training in (0, 1) where lr *= gamma.')
    gamma: float = Field(json_schema_extra=_SCHEDULE, default=0.1, gt=0, le=1, description='multistep: factor applied at each milestone.')
    warmup_iters: int = Field(json_schema_extra=_SCHEDULE, default=10, ge=0, description='Iterations of linear LR warmup.')
    hflip: float = Field(default=0.5, ge=0, le=1, description='Probability of a horizontal flip per image per epoch.')
    augment: Literal["auto", "flip", "ssd", "detr", "yolo"] = Field(default="auto", description="Train-time augmentation preset (docs/augment.md, detpipe.data.train_transforms): flip (hflip only), ssd (torchvision's SSD recipe: photometric distort, zoom-out, IoU crop), detr (RT-DETRv2's: the same with IoU crop p 0.8, off for the last epoch), yolo (Ultralytics' defaults: mosaic, HSV-like colour jitter, scale 0.5, translate 0.1, mosaic closed for the last 10 % of epochs); auto: the model's (ssd* models ssd, rtdetr/dfine/deim detr, others flip). Every preset also flips with hflip. The keys photometric .. stop_augment override the preset's values (null: the preset's).")
    photometric: Optional[float] = Field(default=None, ge=0, le=1, description="Probability of the colour op per image (ssd/detr: RandomPhotometricDistort; yolo: ColorJitter with Ultralytics' HSV gains); null = the preset's (ssd/detr 0.5, yolo 1, flip 0).")
    zoom_out: Optional[float] = Field(default=None, ge=1, description="Largest side ratio of RandomZoomOut (side_range 1..zoom_out, p 0.5); 1 = off; null = the preset's (ssd/detr 4).")
    iou_crop: Optional[float] = Field(default=None, ge=0, le=1, description="Probability that RandomIoUCrop is tried per image; null = the preset's (ssd 1, detr 0.8).")
    scale: Optional[float] = Field(default=None, ge=0, lt=1, description="Random scale gain: the affine scale is drawn from [1 - scale, 1 + scale] (RandomAffine); null = the preset's (yolo 0.5).")
    translate: Optional[float] = Field(default=None, ge=0, le=0.5, description="Largest random shift as a fraction of the image side (RandomAffine translate); null = the preset's (yolo 0.1).")
    mosaic: Optional[float] = Field(default=None, ge=0, le=1, description="Probability of a 4-image mosaic per sample (partners drawn from (seed, epoch, index)); null = the preset's (yolo 1).")
    mixup: Optional[float] = Field(default=None, ge=0, le=1, description="Probability of blending a sample with another one (ratio ~ Beta(32, 32), targets concatenated); null = the preset's (yolo 0, as Ultralytics).")
    copy_paste: Optional[float] = Field(default=None, ge=0, le=1, description="Probability of pasting a random half of another sample's objects (their mask pixels) onto a sample; occluded objects' masks are cut and their boxes re-derived from the masks (torchvision.ops.masks_to_boxes), fully covered ones dropped (Ghiasi et al. 2021, Simple Copy-Paste; Ultralytics' copy_paste); closed with the mosaic (close_mosaic). Needs a cache with instance masks; null = off (every preset's, as Ultralytics' default 0).")
    multi_scale: Optional[Union[float, list[int]]] = Field(default=None, description="Multi-scale training sizes, drawn per optimizer step (every image of the step, on every rank) from (seed, epoch, iteration): a list of square sides in pixels (multiples of 32), or a fraction f: the multiples of 32 within the cache's size x [1 - f, 1 + f]; 0 = off; off with the mosaic for the last close_mosaic / stop_augment epochs (RT-DETR's stop_epoch). Only for models that take a variable input size (the transformers DETRs; SSD's fixed size and R-CNN's own resize refuse it); null = the preset's (detr 0.25: RT-DETRv2's 480..800 around 640; the others off, as Ultralytics' multi_scale: false).")
    augment_device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where the train-time augmentation runs: cpu (in the loader: the training process or train.num_workers CPU workers), cuda (the training process decodes the JPEG cache with nvJPEG and runs the same transforms on the GPU, the loader only reads; needs training on CUDA), auto: cuda when training on CUDA, else cpu. The same draws either way (docs/augment.md).")
    close_mosaic: Optional[int] = Field(default=None, ge=0, description="The last this many epochs run without mosaic and mixup; null = the preset's (yolo: max(1, round(0.1 x epochs)), Ultralytics' 10 of 100).")
    stop_augment: Optional[int] = Field(default=None, ge=0, description="The last this many epochs run with the flip only (RT-DETR's stop_epoch); null = the preset's (detr 1).")
    seed: int = Field(default=0, description="Seed of the sampler, flips, augmentation draws and model init (every rank's RNG derives from it).")
    num_workers: int = Field(json_schema_extra=_RUN, default=0, ge=0, description='DataLoader worker processes per training process.')
    checkpoint_every: int = Field(json_schema_extra=_RUN, default=20, ge=1, description='Iterations between checkpoints (and one at the end).')
    keep_last: int = Field(json_schema_extra=_RUN, default=2, ge=1, description='Checkpoints kept (older ones deleted).')
    resume: Literal["auto", "restart", "never", "must"] = Field(json_schema_extra=_RUN, default="auto", description='auto: continue from the newest checkpoint of the same training (same params but the schedule keys, same data), the lr schedule re-planned from its iteration for changed schedule keys (docs/train.md, "Continuing a run"); restart: resume only a checkpoint of identical params, else start fresh; never: start fresh; must: as auto, but fail without such a checkpoint.')
    amp: Literal["off", "bf16", "fp16"] = Field(default="off", description='Mixed precision: off, bf16 (autocast) or fp16 (autocast + grad scaler on CUDA).')
    max_bad_steps: int = Field(default=5, ge=0, description='Non-finite-loss steps skipped before training stops with an error.')
    threads: int = Field(json_schema_extra=_RUN, default=0, ge=0, description='torch intra-op threads per process; 0 = cores / nproc_per_node.')
    deterministic: bool = Field(default=False, description='torch.use_deterministic_algorithms(True).')
    channels_last: bool = Field(default=False, description='Model and inputs in channels_last memory format.')
    compile: bool = Field(default=False, description='torch.compile the model.')
    ema: bool = Field(default=False, description='Keep an exponential moving average of the weights; it is what gets evaluated and exported.')
    ema_decay: float = Field(json_schema_extra=_SCHEDULE, default=0.9998, gt=0, lt=1, description='EMA decay per iteration.')
    eval_every: int = Field(json_schema_extra=_RUN, default=0, ge=0, description='Iterations between COCO evaluations on val (0 = off); the best goes to checkpoints/best.pt.')
    patience: int = Field(json_schema_extra=_SCHEDULE, default=0, ge=0, description='Early stopping: stop after this many evaluations in a row (eval_every) whose val AP does not exceed the best so far by more than min_delta; 0 = off. Every rank stops at the same iteration; the count is checkpoint state.')
    min_delta: float = Field(json_schema_extra=_SCHEDULE, default=0.0, ge=0, description='Early stopping: the smallest val AP gain (AP@[.5:.95], 0..1) that counts as an improvement.')
    final: Literal["last", "best"] = Field(json_schema_extra=_RUN, default="last", description='Weights written to models/model.pt: last (the final iteration, its EMA with ema) or best (checkpoints/best.pt: the highest val AP of the evaluations; needs eval_every).')
    log_every: int = Field(json_schema_extra=_RUN, default=1, ge=1, description='Iterations between DVCLive metric rows.')
    cache_url: Optional[str] = Field(json_schema_extra=_RUN, default=None, description='Read the augmentation cache from this URL (s3://bucket/cache?endpoint_override=host:port&scheme=http) instead of data/cache.')
    cache_local_dir: Optional[str] = Field(json_schema_extra=_RUN, default=None, description='cache_url: folder where whole shards are prefetched before use (deleted when consumed); null = a temporary folder.')
    cache_local_bytes: int = Field(json_schema_extra=_RUN, default=2_000_000_000, ge=1, description='cache_url: bytes of prefetched shards held in cache_local_dir, copies in flight included (about; a shard needed now is fetched even beyond it). The prefetcher keeps about 2 x consumption rate x copy time of shards ahead: the bound must hold that (and at least 2 x 8 shards) for the loader never to wait.')
    log_every_s: float = Field(json_schema_extra=_RUN, default=30.0, gt=0, description='Seconds between progress log lines (iteration/total, epoch, loss, lr, images/s, ETA) when stderr is not a terminal; a terminal gets a tqdm bar.')
    max_restarts: int = Field(json_schema_extra=_LAUNCH, default=3, ge=0, description='Times torchrun restarts the worker group after a worker or node fails (torchrun --max-restarts); every restart resumes from the newest checkpoint.')
    rdzv_id: Optional[str] = Field(json_schema_extra=_LAUNCH, default=None, pattern=r"^[A-Za-z0-9_.-]+$", description='Job id of the rendezvous (torchrun --rdzv-id), the same on every node; null = $SLURM_JOB_ID under Slurm, else derived from the params.')
    rdzv_join_timeout_s: int = Field(json_schema_extra=_LAUNCH, default=600, ge=1, description='Seconds a (re)starting node waits for at least MIN nodes to join the rendezvous before the job fails.')
    rdzv_last_call_s: int = Field(json_schema_extra=_LAUNCH, default=30, ge=0, description='Seconds the rendezvous waits for more nodes (up to MAX) once MIN have joined.')
    socket_ifname: Optional[str] = Field(json_schema_extra=_LAUNCH, default=None, pattern=r"^[A-Za-z0-9_.:,^-]+$", description='Network interface(s) of the workers\' gloo / NCCL traffic between nodes, e.g. eth1 (exported as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME); null = torch\'s choice from the hostname (a loopback endpoint uses lo). Set it on a cluster whose hostname does not resolve to the address the other nodes reach.')
    collective_timeout_s: float = Field(json_schema_extra=_LAUNCH, default=600, gt=0, description='Seconds a collective (all-reduce, barrier) may wait for its peers before the worker fails with one line naming the lost rank and host, so that torchrun restarts the group from the newest checkpoint instead of hanging on a node that dropped off the network (torch defaults: gloo 30 min, nccl 10 min). Must exceed the longest time ranks wait for rank 0 alone (evaluation with eval_every, a checkpoint write).')
    launcher: Literal["local", "slurm"] = Field(json_schema_extra=_LAUNCH, default="local", description='local: run torchrun here; slurm: submit the job with sbatch, stream its log, wait, scancel it when this stage is stopped.')
    slurm_partition: Optional[str] = Field(json_schema_extra=_LAUNCH, default=None, description='Slurm partition (sbatch --partition); null = the cluster default.')
    slurm_time: str = Field(json_schema_extra=_LAUNCH, default="24:00:00", pattern=r"^[0-9:-]+$", description='Slurm time limit of the job (sbatch --time).')
    slurm_tasks_per_node: int = Field(json_schema_extra=_LAUNCH, default=1, ge=1, description='torchrun agents per Slurm node (1 on a real cluster; 2 lets one machine act as two nodes in tests).')
    slurm_cpus_per_task: int = Field(json_schema_extra=_LAUNCH, default=0, ge=0, description='CPU cores per agent (sbatch --cpus-per-task); 0 = not set.')
    slurm_extra: list[str] = Field(json_schema_extra=_LAUNCH, default_factory=list, description='Extra sbatch options, one per item, e.g. "--gres=gpu:8" or "--account=proj".')
    k8s_image: str = Field(json_schema_extra=_LAUNCH, default="detpipe:latest", description='Container image of the Kubernetes manifest (python -m detpipe.launch.emit k8s).')
    k8s_pvc: Optional[str] = Field(json_schema_extra=_LAUNCH, default=None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description='Name of a ReadWriteMany PersistentVolumeClaim the Kubernetes manifest mounts in every pod at checkpoints/, models/ and dvclive/ (subPaths of those names: rank 0 writes them from whichever pod it runs in, any pod may resume); null = none: the manifest then refuses nnodes MAX > 1, and for one pod warns that the outputs are lost with the container.')
    k8s_gpus: int = Field(json_schema_extra=_LAUNCH, default=0, ge=0, description='GPUs each Kubernetes pod requests (resources limits and requests nvidia.com/gpu); 0 = none (CPU pods). Else at least nproc_per_node (one worker process per GPU: fewer is refused, more warns of idle GPUs).')

    @field_validator("amp", mode="before")
    @classmethod
    def _amp_off(cls, v):
        # YAML 1.1 (PyYAML) reads an unquoted `off` as False; DVC's `-S` rewrites params.yaml unquoted.
        return "off" if v is False else v

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes_str(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # YAML `nnodes: 2`

    @model_validator(mode="after")
    def _check(self):
        lo, _, hi = self.nnodes.partition(":")
        if hi and int(hi) < int(lo):
            raise ValueError(f"train.nnodes {self.nnodes!r}: MAX must be >= MIN")
        if any(not 0 < m < 1 for m in self.milestones) or self.milestones != sorted(self.milestones):
            raise ValueError("train.milestones must be increasing fractions of training in (0, 1)")
        for key in ("close_mosaic", "stop_augment"):
            if getattr(self, key) is not None and getattr(self, key) > self.epochs:
                raise ValueError(f"train.{key} ({getattr(self, key)}) must be at most train.epochs ({self.epochs})")
        if self.augment == "flip" and any(getattr(self, k) for k in ("photometric", "iou_crop", "scale", "translate",
                                                                      "mosaic", "mixup", "copy_paste")) or \
                self.augment == "flip" and (self.zoom_out or 1) > 1:
            raise ValueError("train.augment: flip has no augmentation ops to tune: choose a preset (ssd, detr, "
                             "yolo) for photometric, zoom_out, iou_crop, scale, translate, mosaic, mixup or copy_paste")
        ms = self.multi_scale
        if isinstance(ms, list) and (not ms or any(s < 32 or s % 32 for s in ms)):
            raise ValueError(f"train.multi_scale {ms}: sizes must be a non-empty list of multiples of 32 pixels")
        if isinstance(ms, float) and not 0 <= ms < 1:
            raise ValueError(f"train.multi_scale {ms}: a fraction must be in [0, 1)")
        if (self.patience or self.final == "best") and not self.eval_every:
            raise ValueError("train.patience and train.final: best need val evaluations: set train.eval_every")
        return self


def train_keys(role: TrainRole) -> frozenset[str]:
    """The `Train` fields of one role (each field's ``json_schema_extra["role"]``; a field without one is
    ``"result"``). The one classification of the train keys, read by the checkpoint fingerprint
    (`detpipe.engine.checkpoints.fingerprint`), schedule continuation (``schedule``) and the launch params
    (`detpipe.launch.stage.LaunchParams`, ``launch``):

    - ``result``: changes which training it is (model, data handling, augmentation, seed, batch, precision...).
    - ``schedule``: only the schedule of the same training (`_SCHEDULE`).
    - ``run``: how this run goes, not its result (`_RUN`).
    - ``launch``: only how the job is launched (`_LAUNCH`).
    """
    return frozenset(k for k, f in Train.model_fields.items() if _role_of(f) == role)


def _role_of(field) -> str:
    return (field.json_schema_extra or {}).get("role", "result")


class Evaluate(_Section):
    batch_size: int = Field(default=16, ge=1, description='Images per forward pass.')
    backend: Literal["pycocotools", "faster_coco_eval"] = Field(default="faster_coco_eval", description='COCOeval implementation: faster_coco_eval (C++, faster) or the pycocotools reference (identical stats).')
    score_threshold: float = Field(default=0.0, ge=0, le=1, description='Detections below this score are not scored.')
    nproc_per_node: int = Field(default=1, ge=1, description='Processes that each predict part of val (torchrun); rank 0 scores.')
    num_plot_images: int = Field(default=4, ge=0, description='Val images drawn with predicted and ground-truth boxes under plots/.')
    plot_score_threshold: float = Field(default=0.3, ge=0, le=1, description='Predicted boxes drawn at or above this score; also the lowest score of a detection in the confusion matrix and the worst-image ranking.')
    num_worst_images: int = Field(default=4, ge=0, description='Val images with the most errors (false positives plus missed objects at IoU 0.5, score >= plot_score_threshold) drawn under plots/worst_images/.')


class Export(_Section):
    opset: int = Field(default=17, ge=11, description='ONNX opset version.')
    num_images: int = Field(default=4, ge=1, description='Val images used by the parity check.')
    score_threshold: float = Field(default=0.05, ge=0, le=1, description='Eager detections at or above this score are matched in each exported model (report figures, not the verdict).')
    iou_match: float = Field(default=0.99, gt=0, le=1, description='IoU at or above which an exported detection matches an eager one (same label).')
    rtol: float = Field(default=1e-3, gt=0, description='Parity gate: each raw pre-NMS head output of an exported file must equal the eager one within rtol x its root-mean-square magnitude.')
    require_parity: bool = Field(default=True, description='false: export even when the parity gate compared nothing (a model without a known head).')
    torchscript: bool = Field(default=False, description='Also write models/torchscript/model.ts (torch.jit.script; deprecated by PyTorch, for LibTorch/C++ deployments).')
    torch_export: bool = Field(default=True, description='Write and check models/torch_export/model.pt2 (torch.export, dynamic H and W); false leaves the folder empty. Exporting and loading the file back are most of this stage\'s time (about 45 of 55 s for the default model on 2 CPU cores); ONNX alone is then checked.')
    formats: list[Literal["openvino", "int8"]] = Field(default_factory=list, description='Extra deployment formats (opt-in: they add ~2 min to the default run\'s export stage on 2 CPU cores, docs/export.md) made from the checked ONNX file: openvino (models/openvino/model.xml + .bin, OpenVINO IR for its CPU runtime; the same raw-output parity gate as ONNX) and int8 (models/int8/model.int8.onnx, QDQ, quantized by int8_method, calibrated on calibration_images train images; gated by max_ap_drop and max_count_ratio). [] (default) writes neither (the folders stay empty).')
    calibration_images: int | None = Field(default=None, ge=1, description='int8: training images of the augmentation cache (data/cache/train, evenly spaced) whose activation ranges calibrate the quantization; null (default): every train image, at most 300 (NNCF\'s subset_size).')
    int8_method: Literal["auto", "accuracy_control", "plain"] = Field(default="auto", description='int8 quantizer: plain (onnxruntime quantize_static, every network layer int8 but the score head: the fastest file on x86 CPUs), accuracy_control (NNCF quantize_with_accuracy_control on the ONNX file: layers whose quantization costs val AP are reverted to float until the AP drop is within max_ap_drop; its QDQ file runs slower in onnxruntime, docs/benchmarks.md), or auto (default): plain, and accuracy_control only when the plain file fails the gate.')
    max_ap_drop: float = Field(default=0.02, ge=0, le=1, description='int8 accuracy gate: COCO AP and AP50 (0-1, as metrics/eval.json) of the int8 model on val may each be at most this much below the eager model\'s on the same images (0.02 = 2 AP points); also the accuracy-control bound.')
    count_score: float = Field(default=0.25, gt=0, le=1, description='int8 score-calibration gate: detections on val at or above this score are counted for int8 and eager (predict\'s default threshold).')
    max_count_ratio: float = Field(default=1.5, ge=1, description='int8 score-calibration gate: the int8 count of detections at or above count_score may be at most this many times the eager count, and at least its reciprocal (a drift like 611 -> 4,414 fails even with AP within max_ap_drop).')
    on_gate_fail: Literal["error", "skip"] = Field(default="error", description='A format other than model.onnx that fails its gate: error (the stage fails and writes nothing) or skip (that format\'s folder stays empty, the others are written, export_report.json, the model card and metrics/export.json say why; exit 0).')


class Flows(_Section):
    retries: int = Field(default=1, ge=0, description='Retries of each stage task in the Prefect flow.')
    retry_delay_s: float = Field(default=10, ge=0, description="Seconds between a stage task's retries.")
    max_parallel: int = Field(default=1, ge=1, description="Flow runs (experiments) executed at once: the Prefect deployment's concurrency limit and a sweep's parallel runs.")
    push_checkpoints_every: int = Field(default=1, ge=0, description="A run that syncs with the remotes (--source deployments) pushes training's checkpoints to the DVC remote, as a partial experiment on git's origin, every this many new checkpoints (0: only when the run ends or is interrupted); a retry on another worker resumes from the newest pushed one.")


SEARCH_DISTRIBUTIONS = ("loguniform", "uniform", "int", "choice")
SEARCH_SECTIONS = ("train", "augment")
"""The sections a search may vary (``search.space`` keys): what a training (and its data) is."""


def parse_space_item(path: str, spec) -> tuple[str, list]:
    """One ``search.space`` entry ``path: spec`` -> ``(distribution, args)``: ``"loguniform LOW HIGH"``,
    ``"uniform LOW HIGH"``, ``"int LOW HIGH"`` (LOW < HIGH, loguniform LOW > 0) or ``"choice V1 V2 ..."`` (each value
    read as YAML, at least two). Every value it can give (both bounds, every choice) is checked against ``path``'s
    field in its section, with the field's own constraints.

    Raises:
        ValueError: the key is not ``<train|augment>.<field>``, the distribution is unknown, or a value breaks the
            field's rule (the message names the key).
    """
    from pydantic import TypeAdapter

    section, _, key = path.partition(".")
    if section not in SEARCH_SECTIONS:
        raise ValueError(f"{path!r}: a search varies only {' or '.join(SEARCH_SECTIONS)} params (<section>.<key>)")
    field = Params.model_fields[section].annotation.model_fields.get(key)
    if field is None:
        raise ValueError(f"{path!r}: no such param")
    words = str(spec).split() if isinstance(spec, str) else []
    if not words or words[0] not in SEARCH_DISTRIBUTIONS:
        raise ValueError(f"{path}: {spec!r}: expected one of '{' | '.join(d + ' ...' for d in SEARCH_DISTRIBUTIONS)}'")
    dist, args = words[0], [YAML(typ="safe", pure=True).load(w) for w in words[1:]]
    if dist == "choice":
        if len(args) < 2:
            raise ValueError(f"{path}: choice needs at least two values (got {spec!r})")
    else:
        kind = int if dist == "int" else (int, float)
        if len(args) != 2 or not all(isinstance(a, kind) and not isinstance(a, bool) for a in args) \
                or not args[0] < args[1]:
            raise ValueError(f"{path}: {dist} needs two {'integers' if dist == 'int' else 'numbers'} LOW < HIGH "
                             f"(got {spec!r})")
        if dist == "loguniform" and args[0] <= 0:
            raise ValueError(f"{path}: loguniform needs LOW > 0 (got {spec!r})")
        args = [float(a) for a in args] if dist != "int" else args
    adapter = TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)
    for v in args:
        try:
            adapter.validate_python(v)
        except ValidationError as e:
            raise ValueError(f"{path}: value {v!r} of {spec!r}: {e.errors()[0]['msg']}") from None
    return dist, args


class Search(_Section):
    study: str = Field(default="detpipe", pattern=r"^[A-Za-z0-9_-]+$", description="Name of the Optuna study; each trial is the DVC experiment <study>-t<trial number>.")
    objective: Literal["AP", "AP50"] = Field(default="AP50", description="What the search maximises: bbox AP@[.5:.95] (AP) or AP50 of metrics/eval.json, and the val AP of the same kind that training reports to the pruner at every train.eval_every.")
    space: dict[str, str] = Field(default_factory=dict, description="Params to vary, <train or augment>.<key>: 'loguniform LOW HIGH', 'uniform LOW HIGH', 'int LOW HIGH' or 'choice V1 V2 ...' (values read as YAML); every value it can give is checked against that key's own rule. Empty: nothing to search.")
    sampler: Literal["tpe", "random"] = Field(default="tpe", description="Optuna sampler: tpe (TPESampler) or random (RandomSampler), seeded with seed.")
    seed: int = Field(default=0, description="Seed of the sampler.")
    pruner: Literal["median", "hyperband", "none"] = Field(default="median", description="Optuna pruner over the val AP training reports at train.eval_every: median (MedianPruner), hyperband (HyperbandPruner) or none. Pruning needs train.eval_every > 0.")
    startup_trials: int = Field(default=2, ge=0, description="median: trials that complete before any trial is pruned (MedianPruner n_startup_trials); also TPE's random start-up trials.")
    n_trials: int = Field(default=8, ge=1, description="Trials of the study in all (every search on it together: a resumed or second search only runs what is missing).")
    max_parallel: int = Field(default=1, ge=1, description="Trials trained at once by one search (each its own workspace and training).")
    storage: Optional[str] = Field(default=None, description="Optuna storage: null = the journal file search/<study>.journal in the repository (JournalStorage, file backend); a path ending .journal (journal file) or .db (SQLite), relative to the repository; or a database URL (postgresql://user:pass@host/db, sqlite:///abs.db) for searches on many machines.")

    @field_validator("space")
    @classmethod
    def _space(cls, v):
        for path, spec in v.items():
            parse_space_item(path, spec)
        return v


class Params(_Section):
    """The whole params.yaml: one section per stage, plus the Prefect flow's settings."""

    download: Download = Field(description='Fetch the dataset into data/raw.')
    convert: Convert = Field(description='COCO JSON + images -> Arrow shards, validated.')
    augment: Augment = Field(description='Decode/resize cache the loader reads.')
    train: Train = Field(description='Training (torchrun, DDP).')
    evaluate: Evaluate = Field(description='COCO evaluation on val.')
    export: Export = Field(description='TorchScript/ONNX export and parity gate.')
    flows: Flows = Field(description='Prefect flow settings.')
    search: Search = Field(default_factory=Search, description='Hyperparameter search (python -m flows.search, docs/search.md); no stage reads it.')


def load(section: str | None = None, path: Path | str = PARAMS_FILE):
    """Read and validate the params file; return one section (e.g. ``"train"``) or the whole `Params`.

    Raises:
        StageError: the file is missing, is not YAML, or breaks the schema (the message names the key).
    """
    path = Path(path)
    try:
        # YAML 1.2 (ruamel), as DVC reads and writes params: its `-S` rewrites values unquoted, and YAML 1.1
        # (PyYAML) would then read `off` as False and `24:00:00` or `1:2` as base-60 integers.
        raw = YAML(typ="safe", pure=True).load(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path}: file not found (run from the repository root)") from None
    except YAMLError as e:
        raise StageError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    try:
        params = Params.model_validate(raw or {})
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise StageError(f"{path}: key '{key}': {err['msg']} (got {err.get('input')!r})") from None
    return getattr(params, section) if section else params
