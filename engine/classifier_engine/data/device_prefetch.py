"""The training loader on a GPU: the next batch copied (and device-decoded) by a thread on a side stream (docs/data.md).

    python -m classifier_engine fit --config CONFIG --trainer.accelerator=gpu --data.decoder nvjpeg
"""

import contextlib
import functools
import queue
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from classifier_engine.samplers import ResumableDataLoader

_END = object()


def copied(batch: Any, device: torch.device, epoch: int = 0) -> Any:
    """The batch's tensors on `device`: from pinned memory (data.pin_memory) without blocking the host."""
    return apply_to_collection(batch, torch.Tensor, lambda tensor: tensor.to(device, non_blocking=True))


class Prefetcher:
    """`prepare(item)` for each item of `batches` in a thread, `depth` items ahead; on CUDA in a side stream, whose
    work the consuming stream waits for on the device, never on the host (no host sync per step)."""

    def __init__(self, batches: Iterator, prepare: Callable[[Any], Any], device: torch.device, depth: int = 1):
        self.device, self._queue, self._stop = device, queue.Queue(maxsize=depth), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, prepare), daemon=True, name="prefetch")
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.1)
                return True
        return False

    def _run(self, batches: Iterator, prepare: Callable[[Any], Any]) -> None:
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.set_device(self.device)  # per thread
            stream = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for batch in batches:
                    if not self._put((prepare(batch), stream.record_event() if cuda else None)):
                        return
            self._put(_END)
        except BaseException as error:  # the loop's thread raises it (an unreadable file, a device decoder refused)
            self._put(error)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        prepared, ready = item
        if ready is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(ready)  # on the device: the host goes on queueing
            # allocated on the side stream, its memory reused only after the consumer's use
            apply_to_collection(prepared, torch.Tensor, lambda tensor: tensor.record_stream(consumer))
        return prepared

    def close(self) -> None:
        """Stop the thread (an epoch cut short leaves it waiting to hand over its next batch)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=60)


class PrefetchingLoader(ResumableDataLoader):
    """ResumableDataLoader whose batches come out of `prepare(batch, device, epoch)`, run by a Prefetcher; the
    sampler's position still counts the batches handed to the training loop, not the ones prepared ahead."""

    def __init__(self, *args: Any, prepare: Optional[Callable[[Any, torch.device, int], Any]] = None,
                 device: Optional[torch.device] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prepare, self.device = prepare, device or torch.device("cpu")

    def __iter__(self):
        sampler = self.sampler
        step = (self.batch_size or 1) * sampler.num_replicas
        epoch = sampler.epoch  # set by the loop before this first next()
        prepare = functools.partial(self.prepare, device=self.device, epoch=epoch)
        batches = Prefetcher(DataLoader.__iter__(self), prepare, self.device)
        try:
            for batch in batches:
                sampler.position += step
                yield batch
        finally:
            batches.close()
