"""The input pipeline: batches prepared by DataLoader worker processes, in exactly the order (and with exactly the
contents) the training thread would have produced them itself.

A task's stream is split in two:

* the *plan*: which samples form each micro-batch, in which pass. Cheap and deterministic (a seeded shuffle),
  so every worker walks all of it;
* the *build*: turning one plan entry into tensors (decode + multi-crop augmentation, MLM masking). Costly, and
  seeded per (seed, sample, pass) by the datasets themselves, so it gives the same tensors in any process.

Worker ``w`` of ``W`` builds entries ``w, w + W, ...``; PyTorch's DataLoader returns an iterable dataset's batches
round-robin over its workers, which is the plan's order. A stream that cannot be planned ahead (streamed text:
each batch depends on the documents read so far) runs whole in one worker, ahead of the training thread.
"""

from __future__ import annotations

import functools
import signal
from typing import Callable, Iterable, Iterator, Sequence, Tuple

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.task import Batch

PREFETCH_BATCHES = 4  # micro-batches each worker keeps ready


class PlannedBatches(IterableDataset):
    def __init__(self, plan: Callable[[], Iterable[Tuple[Sequence[int], int]]], build: Callable[..., Batch]):
        """``plan()``: endless (sample ids, pass) entries; ``build(ids, pass)``: the micro-batch for one."""
        self.plan, self.build = plan, build

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        for index, (sample_ids, pass_index) in enumerate(self.plan()):
            if index % workers == me:
                yield self.build(sample_ids, pass_index)


def planned_batches(dataset, stream_seed: int, batch_size: int) -> PlannedBatches | None:
    """The plan/build split of a dataset that has one (``plan(seed, batch_size)`` and ``batch(ids, pass)``);
    None for no data or a stream that only runs in order (it then runs whole in one worker)."""
    if dataset is None or not hasattr(dataset, "plan"):
        return None
    return PlannedBatches(functools.partial(dataset.plan, stream_seed, batch_size), dataset.batch)


class WholeStream(IterableDataset):
    """A stream that only runs in order: one worker runs all of it (``load_batches`` allows no more)."""

    def __init__(self, stream: Callable[[], Iterable[Batch]]):
        self.stream = stream

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.stream())


def _leave_signals_to_the_trainer(_worker_id: int) -> None:
    """Workers ignore SIGINT/SIGTERM: the trainer stops cleanly and shuts them down (a worker killed by the
    terminal's Ctrl-C would make the trainer's next batch fail instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def load_batches(dataset: IterableDataset, workers: int, pin_memory: bool) -> Iterator[Batch]:
    """``dataset``'s batches, built by ``workers`` processes (0: on this thread) and pinned for fast copies to a
    GPU. Closing the returned generator stops the workers."""
    if workers == 0:
        yield from dataset
        return
    if isinstance(dataset, WholeStream):
        workers = 1
    loader = DataLoader(
        dataset,
        batch_size=None,  # the datasets yield whole micro-batches
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=PREFETCH_BATCHES,
        worker_init_fn=_leave_signals_to_the_trainer,
    )
    iterator = iter(loader)
    try:
        yield from iterator
    finally:
        del iterator  # stops the worker processes
