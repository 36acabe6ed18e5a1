"""The serve command's model worker: a bounded queue of prepared images consumed by one worker that runs them in
micro-batches (`Batcher`)."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging

import torch

from detpipe.predict import Runner

log = logging.getLogger("detpipe.serve")


class QueueFull(Exception):
    """The queue holds ``queue_size`` images already: the request is refused (HTTP 503), not queued."""


@dataclasses.dataclass
class _Item:
    image: torch.Tensor
    future: asyncio.Future


class Batcher:
    """One model worker consuming a bounded queue, in micro-batches.

    A request is first admitted (`admit`; refused with `QueueFull` when ``queue_size`` requests are already
    admitted and not yet in a batch: decoding or queued), then, once decoded, `submit` queues its image and waits
    for the worker. The worker (`run_forever`, one asyncio task) takes the first queued image, then whatever else is
    queued or arrives within ``max_wait_s`` of it, up to ``max_batch`` images, and runs them as one batch of the
    model in ``executor`` (one thread: one batch at a time); the next batch forms from what queued meanwhile. So at
    most ``queue_size`` prepared images wait and ``max_batch`` run: the memory is bounded whatever the load.

    All methods but `run_forever`'s model call run on the event loop's thread: no locks.

    Args:
        run: the model (`detpipe.predict.load_runner`'s runner: ``float32 (3, h, w)`` images in [0, 1] -> per
            image ``{"boxes", "scores", "labels"}``).
        executor: where the model runs (a one-thread pool).
        max_batch: images per model call (>= 1).
        max_wait_s: seconds the worker waits for more images after the first of a batch (>= 0).
        queue_size: requests admitted and not yet taken into a batch (>= 1).
    """

    def __init__(self, run: Runner, executor: cf.Executor, max_batch: int, max_wait_s: float, queue_size: int):
        self.run, self.executor = run, executor
        self.max_batch, self.max_wait_s, self.queue_size = max_batch, max_wait_s, queue_size
        self.pending = 0  # admitted, not yet taken into a batch
        self.batches = self.images = self.largest_batch = 0
        self._queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=queue_size)

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
        """Un-admit a request that will not be submitted (its image could not be decoded)."""
        self.pending -= 1

    async def submit(self, image: torch.Tensor) -> tuple[dict, int]:
        """Queue an admitted request's prepared image (``float32 (3, h, w)`` in [0, 1]) and wait for the model.

        Returns:
            ``(the runner's output for the image, the size of the batch it ran in)``.
        Raises:
            the runner's exception, when its batch failed.
        """
        item = _Item(image, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(item)   # never full: admit() bounds what is queued
        return await item.future

    async def _next_batch(self) -> list[_Item]:
        """The next batch: the first queued item, then up to ``max_batch`` - 1 more queued or arriving within
        ``max_wait_s`` of it."""
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        deadline = loop.time() + self.max_wait_s
        while len(batch) < self.max_batch:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
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
            try:
                outputs = await loop.run_in_executor(self.executor, self.run, [item.image for item in batch])
            except asyncio.CancelledError:
                for item in batch:
                    item.future.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - answered to the batch's requests (HTTP 500), logged there
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            self.batches += 1
            self.images += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
            for item, out in zip(batch, outputs):
                if not item.future.done():
                    item.future.set_result((out, len(batch)))
