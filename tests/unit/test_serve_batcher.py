"""`detpipe.serve.batcher.Batcher` on the event loop with a real thread pool (issue 49.2): a runner that takes the
batch at once gets one call and every image is answered when it returns; a ``per_image`` runner (the ONNX and
OpenVINO runners: their graphs take one image) gets the images one at a time and each is answered as soon as it
ran; a batch never mixes the runners of two models (a reload)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import torch

from detpipe.serve.batcher import Batcher

STEP_S = 0.05   # each image's model time in the runners below


def _runner(calls: list, per_image: bool, tag: str):
    def run(images: list[torch.Tensor]) -> list[dict]:
        calls.append((tag, [int(im[0, 0, 0]) for im in images]))
        time.sleep(STEP_S * len(images))
        return [{"id": int(im[0, 0, 0]), "tag": tag} for im in images]
    if per_image:
        run.per_image = True
    return run


async def _submit_all(batcher: Batcher, runs: list) -> list[tuple[int, str, int, float]]:
    """Submit image i (a (3, 2, 2) tensor filled with i) for ``runs[i]``, all at once; returns per image (id, tag,
    batch size, seconds until answered)."""
    task = asyncio.create_task(batcher.run_forever())
    t0 = time.monotonic()

    async def one(i, run):
        batcher.admit()
        out, size = await batcher.submit(torch.full((3, 2, 2), float(i)), run)
        return out["id"], out["tag"], size, time.monotonic() - t0
    try:
        return await asyncio.gather(*(one(i, run) for i, run in enumerate(runs)))
    finally:
        task.cancel()


def test_batch_runner_gets_one_call_per_image_runner_answers_each_at_once():
    with cf.ThreadPoolExecutor(1) as pool:
        calls: list = []
        batched = _runner(calls, per_image=False, tag="a")
        got = asyncio.run(_submit_all(Batcher(pool, 4, 0.2, 8), [batched] * 4))
        assert calls == [("a", [0, 1, 2, 3])]
        assert [g[:3] for g in got] == [(i, "a", 4) for i in range(4)]
        assert max(g[3] for g in got) - min(g[3] for g in got) < STEP_S    # all answered when the call returned

        calls = []
        single = _runner(calls, per_image=True, tag="b")
        got = asyncio.run(_submit_all(Batcher(pool, 4, 0.2, 8), [single] * 4))
        assert calls == [("b", [i]) for i in range(4)]
        assert [g[:3] for g in got] == [(i, "b", 4) for i in range(4)]
        times = [g[3] for g in got]
        assert times == sorted(times) and times[-1] - times[0] >= 2 * STEP_S, times   # 3 runs of STEP_S after the 1st


def test_a_batch_never_mixes_models():
    """Images queued for model a, then b, then a: three batches (a, b, a) in queue order, each on its own model."""
    with cf.ThreadPoolExecutor(1) as pool:
        calls: list = []
        a, b = _runner(calls, False, "a"), _runner(calls, False, "b")
        got = asyncio.run(_submit_all(Batcher(pool, 8, 0.2, 8), [a, a, b, b, a]))
    assert calls == [("a", [0, 1]), ("b", [2, 3]), ("a", [4])]
    assert [(g[0], g[1]) for g in got] == [(0, "a"), (1, "a"), (2, "b"), (3, "b"), (4, "a")]
