"""ALBERT pretraining data: documents -> sentences -> sentence-order (SOP) segment pairs -> fixed-length
token tensors (cached), plus masked-LM corruption that is deterministic per (seed, sample, pass)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from common.errors import DataError
from common.seeding import stable_seed
from common.task import SAMPLE_IDS, Batch
from common.text.blocks import shuffled_plan
from common.text.cache import cache_key, load_or_build_examples  # noqa: F401  (ALBERT's callers import them here)

if TYPE_CHECKING:
    from nltk.tokenize.punkt import PunktSentenceTokenizer

logger = logging.getLogger(__name__)

PUNKT_TRAINING_CHARS = 400_000  # enough text for Punkt to learn abbreviations, a few seconds to train


def train_sentence_splitter(documents: Sequence[str]) -> PunktSentenceTokenizer:
    """NLTK's unsupervised Punkt model trained on the corpus itself (no model download needed)."""
    # imported here: nltk takes ~1.5 s to import and only building examples (a cache miss) needs it
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTrainer

    trainer = PunktTrainer()
    sample, size = [], 0
    for document in documents:
        sample.append(document)
        size += len(document)
        if size > PUNKT_TRAINING_CHARS:
            break
    trainer.train("\n\n".join(sample), finalize=True)
    return PunktSentenceTokenizer(trainer.get_params())


@dataclass(frozen=True)
class SpecialIds:
    cls: int
    sep: int
    pad: int
    mask: int
    vocab_size: int


def create_sop_instances(
    document: List[List[int]], max_seq_length: int, short_seq_probability: float, rng: random.Random, ids: SpecialIds
) -> List[Dict[str, List[int]]]:
    """ALBERT's recipe: pack sentences into a chunk, split it into A and B at a sentence boundary, and swap
    A/B with probability 0.5; the label says whether the order was swapped (sentence-order prediction)."""
    max_tokens = max_seq_length - 3
    target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_probability else max_tokens
    instances, chunk, chunk_length = [], [], 0
    for index, sentence in enumerate(document):
        chunk.append(sentence)
        chunk_length += len(sentence)
        if index == len(document) - 1 or chunk_length >= target_length:
            if len(chunk) >= 2:
                split = rng.randint(1, len(chunk) - 1)
                tokens_a = [token for sentence_ in chunk[:split] for token in sentence_]
                tokens_b = [token for sentence_ in chunk[split:] for token in sentence_]
                while len(tokens_a) + len(tokens_b) > max_tokens:  # trim the longer side, alternating ends
                    longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
                    if rng.random() < 0.5:
                        del longer[0]
                    else:
                        longer.pop()
                swapped = rng.random() < 0.5
                if swapped:
                    tokens_a, tokens_b = tokens_b, tokens_a
                if tokens_a and tokens_b:
                    instances.append(_pack(tokens_a, tokens_b, int(swapped), max_seq_length, ids))
            chunk, chunk_length = [], 0
            target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_probability else max_tokens
    return instances


def _pack(tokens_a: List[int], tokens_b: List[int], label: int, max_seq_length: int, ids: SpecialIds) -> dict:
    input_ids = [ids.cls, *tokens_a, ids.sep, *tokens_b, ids.sep]
    token_type_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
    padding = max_seq_length - len(input_ids)
    return {
        "input_ids": input_ids + [ids.pad] * padding,
        "token_type_ids": token_type_ids + [0] * padding,
        "attention_mask": [1] * len(input_ids) + [0] * padding,
        "sentence_order_label": label,
    }


EXAMPLE_DTYPES = {
    "input_ids": np.int32,
    "token_type_ids": np.int8,
    "attention_mask": np.int8,
    "sentence_order_label": np.int8,
}


# documents per unit of work: each shard's examples come from its own random stream, so the result does not depend
# on how many processes build them
DOCUMENTS_PER_SHARD = 2000


def build_examples(
    documents: Sequence[str],
    tokenizer,
    max_seq_length: int,
    short_seq_probability: float,
    seed: int,
    workers: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """SOP examples of ``documents``, built by ``workers`` processes (default: every core this process may use)
    over shards of ``DOCUMENTS_PER_SHARD`` documents. Examples are stored compactly (token ids as int32, the rest
    as int8: 6 bytes per position instead of 24), so a WikiText-103-sized corpus stays within a few GB;
    :class:`SopDataset` widens a micro-batch to int64 when it serves it."""
    splitter = train_sentence_splitter(documents)
    ids = special_ids(tokenizer)
    jobs = [
        (documents[start : start + DOCUMENTS_PER_SHARD], stable_seed(seed, "sop shard", index))
        for index, start in enumerate(range(0, len(documents), DOCUMENTS_PER_SHARD))
    ]
    workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(jobs)))
    builder = _ShardBuilder(splitter, tokenizer, ids, max_seq_length, short_seq_probability)
    # minutes for a large corpus, once (the result is cached): a progress bar when run in a terminal
    progress = dict(total=len(jobs), desc=f"building examples ({workers} processes)", unit="shard", disable=None)
    if workers == 1:
        parts = [builder(job) for job in tqdm(jobs, **progress)]
    else:
        # spawned, not forked: the parent's Rust tokenizer threads and torch state do not survive a fork safely
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            parts = list(tqdm(pool.imap(builder, jobs), **progress))
    parts = [part for part in parts if len(part["input_ids"])]
    if not parts:
        raise DataError(
            f"the corpus gave no sentence-order example: none of its {len(documents)} documents has two sentences "
            "(ALBERT learns the order of consecutive sentences of one document, and each line of a text file is "
            "one document: put each document's sentences on one line, or use .jsonl with a text field per document)"
        )
    return {name: torch.from_numpy(np.concatenate([part[name] for part in parts])) for name in parts[0]}


@dataclass
class _ShardBuilder:
    """Examples of one shard of documents, as compact arrays (picklable: it runs in worker processes)."""

    splitter: "PunktSentenceTokenizer"
    tokenizer: object
    ids: SpecialIds
    max_seq_length: int
    short_seq_probability: float

    def __call__(self, job: Tuple[Sequence[str], int]) -> Dict[str, np.ndarray]:
        documents, seed = job
        rng = random.Random(seed)
        examples: List[dict] = []
        for document in documents:
            sentences = [sentence for sentence in self.splitter.tokenize(document) if sentence.strip()]
            if len(sentences) < 2:
                continue
            encoded = self.tokenizer(sentences, add_special_tokens=False)["input_ids"]
            examples.extend(
                create_sop_instances(
                    [s for s in encoded if s], self.max_seq_length, self.short_seq_probability, rng, self.ids
                )
            )
        return {
            name: np.array([example[name] for example in examples], dtype=dtype).reshape(
                (len(examples), *([self.max_seq_length] if name != "sentence_order_label" else []))
            )
            for name, dtype in EXAMPLE_DTYPES.items()
        }


def special_ids(tokenizer) -> SpecialIds:
    return SpecialIds(
        cls=tokenizer.cls_token_id,
        sep=tokenizer.sep_token_id,
        pad=tokenizer.pad_token_id,
        mask=tokenizer.mask_token_id,
        vocab_size=len(tokenizer),
    )


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    ids: SpecialIds,
    probability: float,
    generator: torch.Generator,
):
    """BERT masking: choose ``probability`` of the real tokens; 80 % -> [MASK], 10 % random, 10 % kept."""
    labels = input_ids.clone()
    special = (input_ids == ids.cls) | (input_ids == ids.sep) | (attention_mask == 0)
    chosen = (torch.rand(input_ids.shape, generator=generator) < probability) & ~special
    labels[~chosen] = -100
    corrupted = input_ids.clone()
    roll = torch.rand(input_ids.shape, generator=generator)
    random_tokens = torch.randint(ids.vocab_size, input_ids.shape, generator=generator)
    corrupted[chosen & (roll < 0.8)] = ids.mask
    replace = chosen & (roll >= 0.8) & (roll < 0.9)
    corrupted[replace] = random_tokens[replace]
    return corrupted, labels


class SopDataset:
    """Fixed-length SOP examples with deterministic dynamic masking."""

    def __init__(self, examples: Dict[str, torch.Tensor], ids: SpecialIds, mlm_probability: float, seed: int):
        self.examples, self.ids, self.mlm_probability, self.seed = examples, ids, mlm_probability, seed

    def __len__(self) -> int:
        return len(self.examples["input_ids"])

    def batch(self, sample_ids: Sequence[int], pass_index: int) -> Batch:
        """The micro-batch for these samples; masking depends only on (seed, sample id, pass)."""
        index = torch.as_tensor(list(sample_ids), dtype=torch.long)
        input_ids = self.examples["input_ids"][index].long()  # stored compactly (build_examples)
        attention_mask = self.examples["attention_mask"][index].long()
        corrupted, labels = [], []
        for row, sample_id in enumerate(index.tolist()):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, "mask", sample_id, pass_index))
            masked, label = mask_tokens(
                input_ids[row : row + 1], attention_mask[row : row + 1], self.ids, self.mlm_probability, generator
            )
            corrupted.append(masked)
            labels.append(label)
        return {
            "input_ids": torch.cat(corrupted),
            "labels": torch.cat(labels),
            "attention_mask": attention_mask,
            "token_type_ids": self.examples["token_type_ids"][index].long(),
            "sentence_order_label": self.examples["sentence_order_label"][index].long(),
            SAMPLE_IDS: index,
            "pass_index": torch.tensor(pass_index),
        }

    def plan(
        self, stream_seed: int, batch_size: int, sample_ids: Sequence[int] | None = None
    ) -> Iterator[Tuple[List[int], int]]:
        """Endless (sample ids, pass) of micro-batches over ``sample_ids`` (default: all), reshuffled each pass by
        ``stream_seed``."""
        return shuffled_plan(len(self), stream_seed, batch_size, sample_ids)

    def stream(self, stream_seed: int, batch_size: int, sample_ids: Sequence[int] | None = None) -> Iterator[Batch]:
        """Endless micro-batches, in ``plan``'s order."""
        for ids, pass_index in self.plan(stream_seed, batch_size, sample_ids):
            yield self.batch(ids, pass_index)
