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


def create_sop_pairs(
    document: List[List[int]], max_seq_length: int, short_seq_probability: float, rng: random.Random
) -> List[Tuple[List[int], List[int], int]]:
    """ALBERT's recipe: pack sentences into a chunk, split it into A and B at a sentence boundary, and swap
    A/B with probability 0.5; the label says whether the order was swapped (sentence-order prediction).
    Returns (A, B, label) triples whose [CLS] A [SEP] B [SEP] fits ``max_seq_length``."""
    max_tokens = max_seq_length - 3
    target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_probability else max_tokens
    pairs, chunk, chunk_length = [], [], 0
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
                    pairs.append((tokens_a, tokens_b, int(swapped)))
            chunk, chunk_length = [], 0
            target_length = rng.randint(2, max_tokens) if rng.random() < short_seq_probability else max_tokens
    return pairs


def create_sop_instances(
    document: List[List[int]], max_seq_length: int, short_seq_probability: float, rng: random.Random, ids: SpecialIds
) -> List[Dict[str, List[int]]]:
    """:func:`create_sop_pairs` as padded model inputs of ``max_seq_length`` tokens."""
    return [
        _pack(tokens_a, tokens_b, label, max_seq_length, ids)
        for tokens_a, tokens_b, label in create_sop_pairs(document, max_seq_length, short_seq_probability, rng)
    ]


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
    over shards of ``DOCUMENTS_PER_SHARD`` documents.

    Stored without padding: ``tokens`` holds every example's [CLS] A [SEP] B [SEP] back to back (int32),
    ``offsets`` where each starts, ``first_segment`` the length of its [CLS] A [SEP] part and
    ``sentence_order_label`` its label; :class:`SopDataset` pads a micro-batch when it serves it. A corpus costs
    about 4 bytes per token, whatever the share of short documents (a padded tensor of 512-token rows took 24 bytes
    per position, most of them padding for paragraph-sized documents)."""
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
    lengths = np.concatenate([part["lengths"] for part in parts])
    if not len(lengths):
        raise DataError(
            f"the corpus gave no sentence-order example: none of its {len(documents)} documents has two sentences "
            "(ALBERT learns the order of consecutive sentences of one document, and each line of a text file is "
            "one document: put each document's sentences on one line, or use .jsonl with a text field per document)"
        )
    return {
        "tokens": torch.from_numpy(np.concatenate([part["tokens"] for part in parts])),
        "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])),
        "first_segment": torch.from_numpy(np.concatenate([part["first_segment"] for part in parts])),
        "sentence_order_label": torch.from_numpy(np.concatenate([part["labels"] for part in parts])),
    }


@dataclass
class _ShardBuilder:
    """Examples of one shard of documents, unpadded (picklable: it runs in worker processes)."""

    splitter: "PunktSentenceTokenizer"
    tokenizer: object
    ids: SpecialIds
    max_seq_length: int
    short_seq_probability: float

    def __call__(self, job: Tuple[Sequence[str], int]) -> Dict[str, np.ndarray]:
        documents, seed = job
        rng = random.Random(seed)
        tokens: List[int] = []
        lengths, first_segment, labels = [], [], []
        for document in documents:
            sentences = [sentence for sentence in self.splitter.tokenize(document) if sentence.strip()]
            if len(sentences) < 2:
                continue
            encoded = self.tokenizer(sentences, add_special_tokens=False)["input_ids"]
            pairs = create_sop_pairs([s for s in encoded if s], self.max_seq_length, self.short_seq_probability, rng)
            for tokens_a, tokens_b, label in pairs:
                tokens += [self.ids.cls, *tokens_a, self.ids.sep, *tokens_b, self.ids.sep]
                lengths.append(len(tokens_a) + len(tokens_b) + 3)
                first_segment.append(len(tokens_a) + 2)
                labels.append(label)
        return {
            "tokens": np.array(tokens, dtype=np.int32),
            "lengths": np.array(lengths, dtype=np.int64),
            "first_segment": np.array(first_segment, dtype=np.int16),
            "labels": np.array(labels, dtype=np.int8),
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

    def __init__(
        self,
        examples: Dict[str, torch.Tensor],
        ids: SpecialIds,
        mlm_probability: float,
        seed: int,
        max_seq_length: int,
    ):
        """``examples``: what :func:`build_examples` returns."""
        self.examples, self.ids, self.mlm_probability, self.seed = examples, ids, mlm_probability, seed
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return len(self.examples["sentence_order_label"])

    def padded(self, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, attention mask and token types of these examples, padded to ``max_seq_length``."""
        tokens, offsets, first = self.examples["tokens"], self.examples["offsets"], self.examples["first_segment"]
        input_ids = torch.full((len(index), self.max_seq_length), self.ids.pad, dtype=torch.long)
        attention_mask = torch.zeros((len(index), self.max_seq_length), dtype=torch.long)
        token_type_ids = torch.zeros((len(index), self.max_seq_length), dtype=torch.long)
        for row, example in enumerate(index.tolist()):
            start, end = int(offsets[example]), int(offsets[example + 1])
            input_ids[row, : end - start] = tokens[start:end]
            attention_mask[row, : end - start] = 1
            token_type_ids[row, int(first[example]) : end - start] = 1
        return input_ids, attention_mask, token_type_ids

    def batch(self, sample_ids: Sequence[int], pass_index: int) -> Batch:
        """The micro-batch for these samples; masking depends only on (seed, sample id, pass)."""
        index = torch.as_tensor(list(sample_ids), dtype=torch.long)
        input_ids, attention_mask, token_type_ids = self.padded(index)
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
            "token_type_ids": token_type_ids,
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
