"""The serve command's model worker: a bounded queue of prepared images consumed by one worker that runs them in
micro-batches (`Batcher`)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging
from typing import Callable

import torch

from detpipe.predict import Runner

log = logging.getLogger("detpipe.serve")


class QueueFull(Exception):
    """The queue holds ``queue_size`` images already: the request is refused (HTTP 503), not queued."""


@dataclasses.dataclass
class _Item:
    image: torch.Tensor
    run: Runner
    future: asyncio.Future


class Batcher:
    """One model worker consuming a bounded queue, in micro-batches.

    A request is first decoded, then admitted (`admit`; refused with `QueueFull` when ``queue_size`` requests are
    already admitted and not yet in a batch), then `submit` queues its image with the model to run it on and waits
    for the worker. The worker (`run_forever`, one asyncio task) takes the first queued image, then whatever else is
    queued or arrives within ``max_wait_s`` of it for the same model, up to ``max_batch`` images, and runs them as
    one batch of that model in ``executor`` (one thread: one batch at a time); the next batch forms from what queued
    meanwhile. So at most ``queue_size`` prepared images wait and ``max_batch`` run: the memory is bounded whatever
    the load. A batch never mixes models: across a model reload (`detpipe.serve.app.Service.reload`) the requests
    submitted for the old model run on it, the new ones on the new model.

    All methods but `run_forever`'s model call run on the event loop's thread: no locks.

    Args:
        executor: where the model runs (a one-thread pool).
        max_batch: images per model call (>= 1).
        max_wait_s: seconds the worker waits for more images after the first of a batch (>= 0).
        queue_size: requests admitted and not yet taken into a batch (>= 1).
        on_batch: called with each batch's size once it ran (metrics).
    """

    def __init__(self, executor: cf.Executor, max_batch: int, max_wait_s: float, queue_size: int,
                 on_batch: Callable[[int], None] = lambda n: None):
        self.executor, self.on_batch = executor, on_batch
        self.max_batch, self.max_wait_s, self.queue_size = max_batch, max_wait_s, queue_size
        self.pending = 0  # admitted, not yet taken into a batch
        self.batches = self.images = self.largest_batch = 0
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_size)
        self._held: _Item | None = None   # taken from the queue for another model than its batch's: the next batch

    def admit(self) -> None:
        """Count one more request against ``queue_size``.

        Raises:
            QueueFull: ``queue_size`` requests are already admitted and not in a batch.
        """
        if self.pending >= self.queue_size:
            raise QueueFull(f"queue full: {self.pending} images waiting for the model (--queue-size "
                            f"{self.queue_size}); retry later")
        self.pending += 1

    def release(self) -> None:
        """Un-admit a request that will not be submitted."""
        self.pending -= 1

    async def submit(self, image: torch.Tensor, run: Runner) -> tuple[dict, int]:
        """Queue an admitted request's prepared image (``float32 (3, h, w)`` in [0, 1]) for the model ``run`` (the
        runner: a list of such images -> per image ``{"boxes", "scores", "labels"}``) and wait for it.

        Returns:
            ``(the runner's output for the image, the size of the batch it ran in)``.
        Raises:
            the runner's exception, when its batch failed.
        """
        item = _Item(image, run, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(item)   # never full: admit() bounds what is queued
        return await item.future

    async def _next_batch(self) -> list[_Item]:
        """The next batch: the first queued item, then up to ``max_batch`` - 1 more for the same model queued or
        arriving within ``max_wait_s`` of it."""
        loop = asyncio.get_running_loop()
        first, self._held = self._held or await self._queue.get(), None
        batch = [first]
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if item.run is not first.run:
                self._held = item
                break
            batch.append(item)
        self.pending -= len(batch)
        return batch

    async def run_forever(self) -> None:
        """The worker: form batches and run them, one at a time, until cancelled. A batch whose run raises fails
        each of its requests with that exception; the worker goes on."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [item for item in await self._next_batch() if not item.future.done()]
            if not batch:
                continue
            run = batch[0].run
            # A runner that runs a batch's images one after the other anyway (``per_image``) gets them one at a time
            # and each is answered as soon as it ran, not when the whole batch has: its client sends its next image
            # while the others run (measured: answering a batch of such a runner at its end served 0.36x the images/s
            # of --max-batch 1, docs/serve.md).
            parts = [[item] for item in batch] if getattr(run, "per_image", False) else [batch]
            try:
                for part in parts:
                    try:
                        outputs = await loop.run_in_executor(self.executor, run, [item.image for item in part])
                    except Exception as e:  # noqa: BLE001 - answered to the part's requests (HTTP 500), logged there
                        for item in part:
                            if not item.future.done():
                                item.future.set_exception(e)
                        continue
                    for item, out in zip(part, outputs):
                        if not item.future.done():
                            item.future.set_result((out, len(batch)))
            except asyncio.CancelledError:
                for item in batch:
                    item.future.cancel()
                raise
            self.batches += 1
            self.images += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
            self.on_batch(len(batch))
