"""Sentence-order (SOP) examples of ALBERT, the part that runs in the example-building worker processes: it
imports neither torch nor the task, so each spawned worker costs a few hundred MB less (``albert.data`` re-exports
these names)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, List, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    from pathlib import Path

    from nltk.tokenize.punkt import PunktSentenceTokenizer

PUNKT_TRAINING_CHARS = 400_000  # enough text for Punkt to learn abbreviations, a few seconds to train


def train_sentence_splitter(documents: Iterable[str]) -> PunktSentenceTokenizer:
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


@dataclass
class ShardBuilder:
    """Examples of one shard of documents, unpadded (picklable: it runs in worker processes)."""

    splitter: "PunktSentenceTokenizer"
    tokenizer: object
    ids: SpecialIds
    max_seq_length: int
    short_seq_probability: float

    def __call__(self, job: Tuple[Sequence[str], int, Path]) -> dict:
        """Builds one shard and writes its arrays to ``<path>-<name>.npy``; returns their sizes."""
        documents, seed, path = job
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
        np.save(f"{path}-tokens.npy", np.array(tokens, dtype=np.int32))
        np.save(f"{path}-lengths.npy", np.array(lengths, dtype=np.int64))
        np.save(f"{path}-first.npy", np.array(first_segment, dtype=np.int16))
        np.save(f"{path}-labels.npy", np.array(labels, dtype=np.int8))
        return {"path": str(path), "documents": len(documents), "examples": len(labels), "tokens": len(tokens)}


def special_ids(tokenizer) -> SpecialIds:
    return SpecialIds(
        cls=tokenizer.cls_token_id,
        sep=tokenizer.sep_token_id,
        pad=tokenizer.pad_token_id,
        mask=tokenizer.mask_token_id,
        vocab_size=len(tokenizer),
    )
