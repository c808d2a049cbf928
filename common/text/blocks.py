"""Fixed-length token blocks for causal language modelling, served by the plan/batch protocol of the input
pipeline (``common.pipeline``): ``plan`` says which samples form each micro-batch, ``batch`` builds one."""

from __future__ import annotations

from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from tqdm import tqdm

from common.seeding import stable_seed
from common.task import SAMPLE_IDS, Batch


def build_blocks(documents: Sequence[str], tokenizer, block_size: int, end_of_text_id: int) -> Dict[str, torch.Tensor]:
    """Every document's tokens followed by the end-of-text token, concatenated and cut into ``block_size`` blocks
    (the last partial block is dropped): ``{"input_ids": LongTensor[blocks, block_size]}``."""
    stream: List[int] = []
    # minutes for a large corpus, once (the result is cached): a progress bar when run in a terminal
    for start in tqdm(range(0, len(documents), 256), desc="tokenizing", unit="x256 docs", disable=None):
        for ids in tokenizer(list(documents[start : start + 256]), add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            stream.append(end_of_text_id)
    count = len(stream) // block_size
    if count == 0:
        raise ValueError(f"the corpus gives {len(stream)} tokens, fewer than one block of {block_size}")
    return {"input_ids": torch.tensor(stream[: count * block_size], dtype=torch.long).view(count, block_size)}


def shuffled_plan(
    size: int, stream_seed: int, batch_size: int, sample_ids: Sequence[int] | None = None
) -> Iterator[Tuple[List[int], int]]:
    """Endless (sample ids, pass) of equal micro-batches over ``sample_ids`` (default: ``range(size)``), reshuffled
    each pass by ``stream_seed``: the same plan in any process."""
    pool = torch.as_tensor(list(sample_ids) if sample_ids is not None else range(size), dtype=torch.long)
    pass_index = 0
    while True:
        generator = torch.Generator().manual_seed(stable_seed(stream_seed, "order", pass_index))
        order = pool[torch.randperm(len(pool), generator=generator)]
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start : start + batch_size].tolist(), pass_index
        pass_index += 1


class BlockDataset:
    """Token blocks for next-token prediction. The dataset protocol of a task's data (``common.task.DatasetTask``):

    * ``plan(stream_seed, batch_size)``: endless ``(sample ids, pass)`` entries, cheap and deterministic;
    * ``batch(sample_ids, pass_index)``: the micro-batch of those samples, the same tensors in any process (any
      randomness is seeded by sample id and pass, never by a process's RNG), so worker processes can build it and
      one process can replay a swarm's logged micro-batches exactly;
    * every batch carries ``SAMPLE_IDS``, the samples' indices, which the loop logs (``debug.record_sample_ids``);
    * ``stream(stream_seed, batch_size)``: ``plan`` built in order.
    """

    def __init__(self, blocks: Dict[str, torch.Tensor]):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks["input_ids"])

    def batch(self, sample_ids: Sequence[int], pass_index: int) -> Batch:
        index = torch.as_tensor(list(sample_ids), dtype=torch.long)
        return {
            "input_ids": self.blocks["input_ids"][index],
            SAMPLE_IDS: index,
            "pass_index": torch.tensor(pass_index),
        }

    def plan(
        self, stream_seed: int, batch_size: int, sample_ids: Sequence[int] | None = None
    ) -> Iterator[Tuple[List[int], int]]:
        return shuffled_plan(len(self), stream_seed, batch_size, sample_ids)

    def stream(self, stream_seed: int, batch_size: int, sample_ids: Sequence[int] | None = None) -> Iterator[Batch]:
        for ids, pass_index in self.plan(stream_seed, batch_size, sample_ids):
            yield self.batch(ids, pass_index)
