"""Loader over the real augmentation cache (COCO128 images): flips, sampler determinism, exact mid-epoch resume,
rank partitioning, worker processes, pinned memory, and reading through filesystem URLs."""
from __future__ import annotations

import math
import shutil

import fsspec
import pyarrow.fs as pafs
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as TF

from detpipe.errors import StageError
from detpipe.data import CachedDetectionDataset, ResumableDistributedSampler, collate


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
    with pytest.raises(ValueError, match="world_size"):
        ResumableDistributedSampler(10, world_size=1, seed=1).load_state_dict(state)
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


def test_reads_through_filesystem_urls(cache, tmp_path):
    local = CachedDetectionDataset(cache, "val", hflip=0.5)
    # pyarrow filesystem URL (the code path of s3:// etc.: no memory map, file handles from the filesystem)
    via_url = CachedDetectionDataset(cache.resolve().as_uri(), "val", hflip=0.5)
    assert via_url._fs is not None and isinstance(via_url._fs, pafs.LocalFileSystem)
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
