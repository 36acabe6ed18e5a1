"""Loader over the real augmentation cache (COCO128 images): flips, sampler determinism, exact mid-epoch resume,
rank partitioning, worker processes, pinned memory, and reading through filesystem URLs."""
from __future__ import annotations

import copy
import json
import math
import shutil

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from detpipe import params as params_mod
from detpipe.core.errors import StageError
from detpipe.core.files import filesystem as open_filesystem
from detpipe.data.dataset import CachedDetectionDataset, collate
from detpipe.data.loader import micro_batches
from detpipe.data.sampler import ResumableDistributedSampler
from detpipe.data.augment import build_cache
from detpipe.engine.elastic import EpochPlan


@pytest.fixture(scope="module")
def cache(cached_workdir):
    return cached_workdir / "data/cache"


def _pixel_span(lo: float, hi: float) -> slice:
    """Pixel columns whose centres lie inside ``[lo, hi]`` (continuous pixel coordinates)."""
    return slice(math.ceil(lo - 0.5), math.floor(hi - 0.5) + 1)


def test_hflip_boxes_and_pixels(cache):
    plain = CachedDetectionDataset(cache, "train", hflip=0.0)
    flipped = CachedDetectionDataset(cache, "train", hflip=1.0)
    n_boxes = 0
    for i in range(len(plain)):
        image, t = plain[i]
        fimage, ft = flipped[i]
        assert torch.equal(fimage, image.flip(-1)) and fimage.is_contiguous()
        h, w = image.shape[-2:]
        # torchvision's own box flip agrees
        ref = TF.horizontal_flip(tv_tensors.BoundingBoxes(t["boxes"], format="XYXY", canvas_size=(h, w)))
        torch.testing.assert_close(ft["boxes"], ref.as_subclass(torch.Tensor), rtol=0, atol=1e-4)
        assert torch.equal(ft["labels"], t["labels"]) and int(ft["image_id"]) == int(t["image_id"])
        for box, fbox in zip(t["boxes"].tolist(), ft["boxes"].tolist()):
            assert fbox[0] < fbox[2] and fbox[1] == box[1] and fbox[3] == box[3]
            # the pixels inside the flipped box are the mirror image of those inside the original box
            rows = _pixel_span(box[1], box[3])
            a = image[:, rows, _pixel_span(box[0], box[2])]
            b = fimage[:, rows, _pixel_span(fbox[0], fbox[2])]
            assert a.shape == b.shape and torch.equal(a, b.flip(-1))
            n_boxes += 1
    assert n_boxes > 0


def test_flips_depend_on_seed_epoch_index_only(cache):
    a = CachedDetectionDataset(cache, "train", hflip=0.5, seed=3)
    b = CachedDetectionDataset(cache, "train", hflip=0.5, seed=3)
    patterns = []
    for epoch in range(6):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        order = list(reversed(range(len(a))))  # access order must not matter
        fa = [a.flipped(i) for i in range(len(a))]
        fb = {i: b.flipped(i) for i in order}
        assert fa == [fb[i] for i in range(len(b))]
        for i in range(len(a)):
            assert torch.equal(a[i][0], b[i][0])
        patterns.append(tuple(fa))
    assert len(set(patterns)) > 1 and any(any(p) for p in patterns) and not all(all(p) for p in patterns)


def test_sampler_is_a_deterministic_permutation_per_seed_and_epoch():
    s = ResumableDistributedSampler(50, seed=1)
    t = ResumableDistributedSampler(50, seed=1)
    orders = []
    for epoch in range(3):
        s.set_epoch(epoch)
        t.set_epoch(epoch)
        assert list(s) == list(t) and sorted(s) == list(range(50))
        orders.append(list(s))
    assert len({tuple(o) for o in orders}) == 3
    other = ResumableDistributedSampler(50, seed=2)
    assert list(other) != orders[0]
    assert list(ResumableDistributedSampler(50, shuffle=False)) == list(range(50))


def _ids(batches) -> list[int]:
    return [int(t["image_id"]) for _, targets in batches for t in targets]


def _run(dataset, sampler, epochs: range, batch_size: int, num_workers: int = 0, stop_after: int | None = None,
         pin_memory: bool = False):
    """Batches of ``epochs``, in the order a training loop sees them; stop after ``stop_after`` batches and return
    ``(batches, sampler state)``."""
    out, state = [], None
    for epoch in epochs:
        # the first epoch continues from the sampler's position if it is in that epoch (a resumed run)
        sampler.set_epoch(epoch, sampler.start if epoch == epochs[0] and sampler.epoch == epoch else 0)
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True,
                            num_workers=num_workers, pin_memory=pin_memory)
        done = 0
        for batch in loader:
            out.append(batch)
            done += 1
            if stop_after is not None and len(out) == stop_after:
                state = sampler.state_dict() if num_workers == 0 else sampler.state_dict(consumed=done * batch_size)
                return out, state
    return out, state


def _same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (ia, ta), (ib, tb) in zip(a, b):
        assert all(x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y) for x, y in zip(ia, ib))
        for x, y in zip(ta, tb):
            assert x.keys() == y.keys()
            assert all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_continues_with_the_same_batches(cache, num_workers):
    def fresh():
        ds = CachedDetectionDataset(cache, "train", hflip=0.5, seed=7)
        return ds, ResumableDistributedSampler(len(ds), seed=7)

    ds, sampler = fresh()
    full, _ = _run(ds, sampler, range(3), batch_size=2)
    per_epoch = len(ds) // 2
    assert len(full) == 3 * per_epoch
    for stop in (1, per_epoch + 1, per_epoch):  # mid-epoch, mid-epoch after a boundary, exactly at a boundary
        ds, sampler = fresh()
        head, state = _run(ds, sampler, range(3), batch_size=2, num_workers=num_workers, stop_after=stop)
        ds, sampler = fresh()  # a new process would start like this
        sampler.load_state_dict(state)
        assert sampler.epoch * per_epoch + sampler.start // 2 == stop and sampler.start % 2 == 0
        tail, _ = _run(ds, sampler, range(sampler.epoch, 3), batch_size=2, num_workers=num_workers)
        assert _ids(head + tail) == _ids(full)
        _same_batches(head + tail, full)


def test_sampler_state_rejects_other_settings():
    state = ResumableDistributedSampler(10, world_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="sharded"):
        ResumableDistributedSampler(10, world_size=2, seed=1, shards=[0] * 10).load_state_dict(state)
    with pytest.raises(ValueError, match="size"):
        ResumableDistributedSampler(12, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ResumableDistributedSampler(10, world_size=2, seed=2).load_state_dict(state)


def test_two_ranks_see_disjoint_samples_covering_the_split(cache):
    ds = CachedDetectionDataset(cache, "train")
    n = len(ds)
    for epoch in range(3):
        ranks = []
        for rank in range(2):
            s = ResumableDistributedSampler(n, world_size=2, rank=rank, seed=0)
            s.set_epoch(epoch)
            ranks.append([int(ds[i][1]["image_id"]) for i in s])
        assert len(ranks[0]) == len(ranks[1]) == n // 2
        assert not set(ranks[0]) & set(ranks[1])
        assert len(set(ranks[0]) | set(ranks[1])) == n - n % 2
    # without drop_last the union is the whole split; only the padding repeats
    ranks = [list(ResumableDistributedSampler(n, 2, r, drop_last=False)) for r in range(2)]
    assert set(ranks[0]) | set(ranks[1]) == set(range(n))
    assert len(ranks[0]) + len(ranks[1]) - n == (-n) % 2


@pytest.mark.parametrize("num_workers,pin_memory", [(2, True)])
def test_workers_and_pinned_memory_give_the_same_batches(cache, num_workers, pin_memory):
    ds = CachedDetectionDataset(cache, "train", hflip=0.5)
    sampler = ResumableDistributedSampler(len(ds), seed=0)
    ref, _ = _run(ds, sampler, range(2), batch_size=3)
    got, _ = _run(ds, ResumableDistributedSampler(len(ds), seed=0), range(2), batch_size=3,
                  num_workers=num_workers, pin_memory=pin_memory)
    _same_batches(got, ref)
    if pin_memory and torch.cuda.is_available():
        assert all(im.is_pinned() for images, _ in got for im in images)


def test_spawned_worker(cache):
    ds = CachedDetectionDataset(cache, "val", hflip=1.0)
    loader = DataLoader(ds, batch_size=2, collate_fn=collate, num_workers=1, multiprocessing_context="spawn")
    got = list(loader)
    ref = list(DataLoader(ds, batch_size=2, collate_fn=collate))
    _same_batches(got, ref)


def _no_memory_map(*args, **kwargs):
    raise AssertionError("memory-mapped")


def test_reads_through_filesystem_urls(cache, tmp_path, monkeypatch):
    local = CachedDetectionDataset(cache, "val", hflip=0.5)
    # pyarrow filesystem URL (the code path of s3:// etc.: no memory map, file handles from the filesystem)
    via_url = CachedDetectionDataset(cache.resolve().as_uri(), "val", hflip=0.5)
    assert isinstance(open_filesystem(cache.resolve().as_uri())[0], pafs.LocalFileSystem)
    with monkeypatch.context() as m:  # a local path is memory-mapped, the URL read through the filesystem
        m.setattr(pa, "memory_map", _no_memory_map)
        with pytest.raises(AssertionError, match="memory-mapped"):
            local[0]
        via_url[0]
    # an fsspec-only scheme
    mem = fsspec.filesystem("memory")
    for f in (cache / "val").iterdir():
        mem.pipe(f"/cache-test/val/{f.name}", f.read_bytes())
    try:
        via_fsspec = CachedDetectionDataset("memory://cache-test", "val", hflip=0.5)
        explicit = CachedDetectionDataset("cache-test", "val", hflip=0.5, filesystem=mem)
        for other in (via_url, via_fsspec, explicit):
            assert other.image_ids == local.image_ids
            _same_batches([collate([other[i] for i in range(len(other))])],
                          [collate([local[i] for i in range(len(local))])])
        # a worker process reads through the URL too
        _same_batches(list(DataLoader(via_url, batch_size=2, collate_fn=collate, num_workers=2)),
                      list(DataLoader(local, batch_size=2, collate_fn=collate)))
    finally:
        mem.rm("/cache-test", recursive=True)


def test_missing_or_incomplete_cache_is_a_one_line_error(cache, tmp_path):
    with pytest.raises(StageError, match="index.arrow: not found") as e:
        CachedDetectionDataset(tmp_path / "nothing", "train")
    assert "\n" not in str(e.value)
    shutil.copytree(cache / "val", tmp_path / "c/val")
    shard = next((tmp_path / "c/val").glob("part-*.arrow"))
    shard.unlink()
    ds = CachedDetectionDataset(tmp_path / "c", "val")
    with pytest.raises(StageError, match=f"{shard.name}: not found"):
        ds[0]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_uint8_output_is_the_float_output_before_scaling(cache):
    f = CachedDetectionDataset(cache, "train", hflip=0.5, seed=2)
    u = CachedDetectionDataset(cache, "train", hflip=0.5, seed=2, image_dtype=torch.uint8)
    for i in range(len(f)):
        (fi, ft), (ui, ut) = f[i], u[i]
        assert ui.dtype == torch.uint8 and ui.is_contiguous()
        assert torch.equal(ui.float().mul_(1 / 255), fi)
        assert all(torch.equal(ft[k], ut[k]) for k in ft)
    ref = list(DataLoader(u, batch_size=4, collate_fn=collate))
    _same_batches(list(DataLoader(u, batch_size=4, collate_fn=collate, num_workers=2)), ref)
    assert ref[0][0][0].data_ptr() != u.pixels(0).data_ptr()  # a copy, never a view of the read-only map


# ---------------------------------------------------------------------------------------------------------------
# Shard-aware sampler, resume at another world size, the one-DataLoader training input, both encodings


def _exactly_once(per_rank: list[list[int]], expected: set[int]) -> bool:
    """Every index of ``expected`` appears exactly once over all ranks' lists, and nothing else does."""
    flat = [i for r in per_rank for i in r]
    return len(flat) == len(set(flat)) and set(flat) == expected


def _shards(n_shards: int, per_shard: int) -> np.ndarray:
    return np.repeat(np.arange(n_shards), per_shard)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_aware_sampler_covers_every_index_once_per_epoch(world_size):
    shards = _shards(23, 7)  # 161 samples
    n = len(shards)
    orders = set()
    for epoch in range(3):
        per_rank = []
        for rank in range(world_size):
            s = ResumableDistributedSampler(n, world_size, rank, seed=5, shards=shards, window=4)
            s.set_epoch(epoch)
            per_rank.append(list(s))
            again = ResumableDistributedSampler(n, world_size, rank, seed=5, shards=shards, window=4)
            again.set_epoch(epoch)
            assert list(again) == per_rank[-1]  # a pure function of (seed, epoch, world size)
        assert len({len(r) for r in per_rank}) == 1
        kept = n - n % world_size
        order = s.order(epoch)
        assert sorted(order.tolist()) == list(range(n))
        assert _exactly_once(per_rank, set(order[:kept].tolist()))
        orders.add(tuple(order.tolist()))
        # blocks of 4 shards: every 28 consecutive samples of the global order come from 4 shards
        for b in range(0, n - n % 28, 28):
            assert len(set(shards[order[b:b + 28]].tolist())) == 4
        # ... and a broken partition (one rank's samples twice) is caught by the check
        assert not _exactly_once(per_rank + [per_rank[0]], set(order[:kept].tolist()))
    assert len(orders) == 3


@pytest.mark.parametrize("w1,w2", [(2, 1), (1, 2), (3, 2), (2, 4)])
def test_resume_at_another_world_size_sees_the_rest_of_the_epoch_once(w1, w2):
    """Record sample ids: ranks of world size W1 consume part of epoch 1, the state goes to W2 ranks, which finish
    the epoch; every sample of the epoch is then seen exactly once (up to the < W2 that drop_last leaves), and
    epoch 2 is the normal W2 epoch."""
    shards = _shards(12, 10)
    n, step = len(shards), 3
    seen = []
    old = [ResumableDistributedSampler(n, w1, r, seed=1, shards=shards, window=2) for r in range(w1)]
    for s in old:
        s.set_epoch(1)
        seen += s.indices()[:5 * step]  # 5 steps of 3 samples on every rank
    state = old[0].state_dict(consumed=5 * step)
    new = [ResumableDistributedSampler(n, w2, r, seed=1, shards=shards, window=2) for r in range(w2)]
    for s in new:
        s.load_state_dict(state)
    remaining = [s.remaining_in_epoch() for s in new]
    assert len(set(remaining)) == 1 and remaining[0] == (n - 5 * step * w1) // w2
    rest = [list(s) for s in new]
    assert [len(r) for r in rest] == remaining
    assert not set(seen) & {i for r in rest for i in r}  # no repeats
    assert _exactly_once([seen] + rest, set(new[0].order(1)[:n - (n - 5 * step * w1) % w2].tolist()))  # no skips
    # mid-way through the resumed epoch, saved again at W2 and loaded at W2: the same continuation
    half = new[0].state_dict(consumed=2)
    again = ResumableDistributedSampler(n, w2, 0, seed=1, shards=shards, window=2)
    again.load_state_dict(half)
    assert list(again) == rest[0][2:]
    # the next epoch is the normal one at W2
    after = new[0].state_dict(consumed=remaining[0])
    assert (after["epoch"], after["start"], after["offset"]) == (2, 0, 0)
    fresh = ResumableDistributedSampler(n, w2, 0, seed=1, shards=shards, window=2)
    fresh.set_epoch(2)
    new[0].load_state_dict(after)
    assert list(new[0]) == list(fresh)


def _steps(gen, n: int) -> list:
    out = [next(gen) for _ in range(n)]
    gen.close()
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_micro_batches_resume_across_epochs_with_one_loader(cache, num_workers):
    """micro_batches (one DataLoader for all epochs, workers alive throughout) started at iteration k gives
    exactly the steps k.. of a run started at 0, across epoch boundaries (variants, flips, order)."""
    ds = CachedDetectionDataset(cache, "train", hflip=0.5, seed=3)
    per_epoch = len(ds) // 2
    sampler = ResumableDistributedSampler(len(ds), seed=3, shards=ds.sample_shards())
    full = [m[0] for m in _steps(micro_batches(ds, sampler, (0, 0, 0), 2, 1), 3 * per_epoch)]
    for k in (1, per_epoch, per_epoch + 2):
        sampler = ResumableDistributedSampler(len(ds), seed=3, shards=ds.sample_shards())
        position = EpochPlan(per_epoch, 2).locate(k)  # as the trainer positions it (no world-size change)
        assert position == (k // per_epoch, k % per_epoch * 2, 0)
        tail = [m[0] for m in _steps(micro_batches(ds, sampler, position, 2, 1, num_workers=num_workers),
                                     3 * per_epoch - k)]
        _same_batches(tail, full[k:])
    assert len({tuple(_ids([b])) for b in full}) > 1


def test_restart_after_a_resized_epoch_reads_what_the_epoch_plan_says(cache):
    """Regression: a run at world size 2 stopped one step into epoch 1, resumed at world size 1 (which finishes
    epoch 1 first, at an iteration the plain schedule does not know), then restarted at world size 1 from a
    checkpoint a few steps into epoch 2. The restart's training input (`micro_batches` positioned by
    `EpochPlan.locate`, as `Trainer.run_step` does) is exactly the uninterrupted continuation's, its checkpoint
    records that position, and every sample is read once per epoch (by image id, which flips cannot change). The
    plain ``divmod(iteration, iters_per_epoch)`` points elsewhere there (a sample of epoch 1, not epoch 2), and for
    a plain resume `EpochPlan.locate` is that plain schedule (the default run reads as before)."""
    ds = CachedDetectionDataset(cache, "train", hflip=0.5, seed=3)
    n, batch_size, accumulate = len(ds), 1, 2
    step, shards = batch_size * accumulate, ds.sample_shards()

    def sampler(world_size: int, rank: int = 0) -> ResumableDistributedSampler:
        return ResumableDistributedSampler(n, world_size, rank, seed=3, shards=shards)

    def read(s, plan: EpochPlan, it: int, count: int) -> list:  # `Trainer.run_step`'s input from iteration ``it``
        return _steps(micro_batches(ds, s, plan.locate(it), batch_size, accumulate), count)

    def checkpoint(s, plan: EpochPlan, done: int) -> dict:  # `Trainer.checkpoint_state`'s sampler entry
        at_next = copy.copy(s)
        at_next.set_epoch(*plan.locate(done))
        return at_next.state_dict(consumed=0)

    def resume(world_size: int, state: dict, done: int):  # `Trainer.load_checkpoint_state`
        s = sampler(world_size)
        s.load_state_dict(state)
        return s, EpochPlan.resumed(done, s, s.num_samples // step, step)

    def ids(steps: list) -> list[int]:
        return [int(t["image_id"]) for micro in steps for _, targets in micro for t in targets]

    def ids_of(epoch: int, indices) -> list[int]:
        return [int(ds[(epoch, int(i))][1]["image_id"]) for i in indices]

    ipe2, ipe1 = sampler(2).num_samples // step, sampler(1).num_samples // step
    assert ipe2 >= 2 and ipe1 >= 3, "the test needs a larger train split"
    assert len(set(ids_of(1, range(n)))) == n  # image ids name samples
    # world size 2 from the start, stopped one step into epoch 1
    stop = ipe2 + 1
    first = [read(sampler(2, r), EpochPlan(ipe2, step), 0, stop) for r in range(2)]
    state = checkpoint(sampler(2), EpochPlan(ipe2, step), stop)
    assert (state["epoch"], state["start"], state["offset"], state["world_size"]) == (1, step, 0, 2)
    # resumed at world size 1: the rest of epoch 1 (the 2 * step samples read at world size 2 skipped), then whole
    # epochs; read uninterruptedly to the end of epoch 2
    s1, plan1 = resume(1, state, stop)
    assert plan1.locate(stop) == (1, 0, 2 * step)
    end1 = stop + plan1.first_iters  # first iteration of epoch 2
    end2 = end1 + ipe1
    cont = read(s1, plan1, stop, end2 - stop)
    # a checkpoint 2 steps into epoch 2, and the restart from it at the same world size
    at = end1 + 2
    state = checkpoint(s1, plan1, at)
    assert (state["epoch"], state["start"], state["offset"], state["world_size"]) == (2, 2 * step, 0, 1)
    assert divmod(at, ipe1) != (2, 2)  # where the plain schedule goes wrong
    s2, plan2 = resume(1, state, at)
    assert plan2.locate(at) == plan1.locate(at) == (2, 2 * step, 0)
    restart = read(s2, plan2, at, end2 - at)
    assert ids(restart) == ids(cont[at - stop:])
    _same_batches([m for st in restart for m in st], [m for st in cont[at - stop:] for m in st])
    # every sample once per epoch: epoch 1 = 1 step per rank at world size 2 + the resumed rest (drop_last: whole
    # steps only), epoch 2 = the continuation up to the checkpoint + the restart
    epoch1 = [i for r in range(2) for i in ids(first[r][ipe2:])] + ids(cont[:plan1.first_iters])
    covered = 2 * step + plan1.first_iters * step
    assert sorted(epoch1) == sorted(ids_of(1, s1.order(1)[:covered]))
    assert len(set(epoch1)) == len(epoch1) == covered
    epoch2 = ids(cont[plan1.first_iters:at - stop]) + ids(restart)
    assert sorted(epoch2) == sorted(ids_of(2, s1.order(2)[:ipe1 * step]))
    assert len(set(epoch2)) == len(epoch2) == ipe1 * step
    # without a change of world size the plan is the plain schedule: same samples, same order as before
    for k in range(3 * ipe1):
        plain = EpochPlan(ipe1, step)
        _, again = resume(1, checkpoint(sampler(1), plain, k), k)
        assert [again.locate(j) for j in range(k, k + ipe1 + 1)] == [plain.locate(j) for j in range(k, k + ipe1 + 1)]
        assert again.locate(k) == (k // ipe1, k % ipe1 * step, 0)


@pytest.fixture(scope="module")
def raw_cache(cached_workdir, tmp_path_factory):
    cfg = params_mod.load("augment", cached_workdir / "params.yaml").model_copy(
        update={"encoding": "raw", "copies": 2})
    out = tmp_path_factory.mktemp("raw") / "cache"
    build_cache(cached_workdir / "data/arrow", out, cfg)
    return out, cfg


def test_both_encodings_same_boxes_labels_and_pixels_within_jpeg_tolerance(cached_workdir, raw_cache, tmp_path):
    """Raw and JPEG caches of the same images with 2 SSD-style copies: identical targets (boxes, labels, scale,
    offset, ids) for every variant and flip, pixels within JPEG quality-90 loss, batched decode = single decode."""
    raw_dir, cfg = raw_cache
    jpeg_dir = tmp_path / "jpeg"
    build_cache(cached_workdir / "data/arrow", jpeg_dir, cfg.model_copy(update={"encoding": "jpeg"}))
    assert json.loads((jpeg_dir / "meta.json").read_text())["encoding"] == "jpeg"
    for split in ("train", "val"):
        r = CachedDetectionDataset(raw_dir, split, hflip=0.5, seed=1)
        j = CachedDetectionDataset(jpeg_dir, split, hflip=0.5, seed=1)
        assert (r.encoding, j.encoding) == ("raw", "jpeg") and r.copies == j.copies == (2 if split == "train" else 1)
        diffs = []
        for epoch in range(2):  # both variants
            r.set_epoch(epoch)
            j.set_epoch(epoch)
            for i in range(len(r)):
                (ri, rt), (ji, jt) = r[i], j[i]
                assert ri.shape == ji.shape and ji.dtype == torch.float32 and ji.is_contiguous()
                assert rt.keys() == jt.keys() and all(torch.equal(rt[k], jt[k]) for k in rt)  # boxes, labels, ...
                d = (ri - ji).abs() * 255
                psnr = 10 * math.log10(255**2 / float((d**2).mean()))
                diffs.append(float(d.mean()))
                assert psnr >= 28.0, (split, epoch, i, psnr)  # JPEG quality 90: ~30-40 dB on photos
        assert 0.3 < np.mean(diffs) < 4.0, np.mean(diffs)  # lossy (not raw), but close
        # batched decode (worker path) equals one-by-one decode
        got = list(DataLoader(j, batch_size=3, collate_fn=collate, num_workers=1))
        _same_batches(got, list(DataLoader(j, batch_size=3, collate_fn=collate)))
    raw_bytes = sum(f.stat().st_size for f in raw_dir.rglob("part-*.arrow"))
    jpeg_bytes = sum(f.stat().st_size for f in jpeg_dir.rglob("part-*.arrow"))
    assert jpeg_bytes * 5 < raw_bytes


def test_corrupt_jpeg_in_cache_is_a_one_line_error_naming_the_shard(cached_workdir, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cached_workdir / "data/cache", cache)
    ds = CachedDetectionDataset(cache, "val")
    assert ds.encoding == "jpeg"
    shard = cache / "val" / ds.shard_names()[0]
    data = bytearray(shard.read_bytes())
    stored = ds._stored(0, ds._record(0))
    start = bytes(data).find(stored.numpy().tobytes()[:64])
    data[start + 2:start + 400] = b"\x00" * 398  # clobber the JPEG header after SOI
    shard.write_bytes(bytes(data))
    with pytest.raises(StageError) as e:
        CachedDetectionDataset(cache, "val")[0]
    assert shard.name in str(e.value) and "\n" not in str(e.value)
