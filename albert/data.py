"""ALBERT pretraining data: documents -> sentences -> sentence-order (SOP) segment pairs -> fixed-length
token tensors (cached), plus masked-LM corruption that is deterministic per (seed, sample, pass)."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from tqdm import tqdm

from albert.sop import (  # noqa: F401  (the recipe's names stay importable from here)
    PUNKT_TRAINING_CHARS,
    ShardBuilder,
    SpecialIds,
    _pack,
    create_sop_instances,
    create_sop_pairs,
    special_ids,
    train_sentence_splitter,
)
from common.errors import DataError
from common.seeding import stable_seed
from common.task import SAMPLE_IDS, Batch
from common.text.blocks import shuffled_plan
from common.text.cache import cache_key, load_or_build_examples  # noqa: F401  (ALBERT's callers import them here)

logger = logging.getLogger(__name__)

# documents per unit of work: each shard's examples come from its own random stream, so the result does not depend
# on how many processes build them
DOCUMENTS_PER_SHARD = 2000
# the stored arrays (one .npy file each, read memory-mapped) and their types
EXAMPLE_ARRAYS = {"tokens": np.int32, "offsets": np.int64, "first_segment": np.int16, "sentence_order_label": np.int8}
COMPLETE_MARKER = "examples.json"  # written last: a folder without it is an interrupted build

Documents = Union[Sequence[str], Callable[[], Iterable[str]]]


def build_examples(
    documents: Documents,
    tokenizer,
    max_seq_length: int,
    short_seq_probability: float,
    seed: int,
    workers: Optional[int] = None,
    folder: Optional[Path] = None,
) -> Dict[str, np.ndarray]:
    """SOP examples of ``documents`` (a sequence, or a function returning a fresh iterator over them: it is read
    twice, never held whole), built by ``workers`` processes (default: every core this process may use) over
    shards of ``DOCUMENTS_PER_SHARD`` documents read one after another.

    Stored without padding: ``tokens`` holds every example's [CLS] A [SEP] B [SEP] back to back (int32),
    ``offsets`` where each starts, ``first_segment`` the length of its [CLS] A [SEP] part and
    ``sentence_order_label`` its label; :class:`SopDataset` pads a micro-batch when it serves it (about 4 bytes
    per token). Each worker writes its shard's arrays to disk and the shards are appended to one ``.npy`` file per
    array in ``folder``, so memory stays bounded by a few shards whatever the corpus's size; the arrays returned
    are read memory-mapped from ``folder`` (in memory when no folder is given)."""
    open_documents = documents if callable(documents) else (lambda: iter(documents))
    splitter = train_sentence_splitter(open_documents())
    ids = special_ids(tokenizer)
    builder = ShardBuilder(splitter, tokenizer, ids, max_seq_length, short_seq_probability)
    shards = _batched(open_documents(), DOCUMENTS_PER_SHARD)
    # a corpus of one or two shards is built here: starting worker processes would cost more than it saves
    first_shards = list(itertools.islice(shards, 2))
    shards = itertools.chain(first_shards, shards)
    workers = 1 if len(first_shards) < 2 else max(1, workers or len(os.sched_getaffinity(0)))
    if folder is not None:
        folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sop-shards-", dir=folder.parent if folder else None) as scratch:
        jobs = (
            (shard, stable_seed(seed, "sop shard", index), Path(scratch) / f"{index:07d}")
            for index, shard in enumerate(shards)
        )
        # minutes for a large corpus, once (the result is cached): a progress bar when run in a terminal
        progress = tqdm(desc=f"building examples ({workers} processes)", unit="shard", disable=None)
        if workers == 1:
            parts = [_tick(progress, builder(job)) for job in jobs]
        else:
            # spawned, not forked: the parent's Rust tokenizer threads and torch state do not survive a fork
            # safely. At most two shards per worker are in flight, so the corpus is never read ahead.
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                parts, pending = [], collections.deque()
                for job in jobs:
                    pending.append(pool.apply_async(builder, (job,)))
                    if len(pending) >= 2 * workers:
                        parts.append(_tick(progress, pending.popleft().get()))
                parts += [_tick(progress, result.get()) for result in pending]
        progress.close()
        documents_read = sum(part["documents"] for part in parts)
        if not sum(part["examples"] for part in parts):
            raise DataError(
                f"the corpus gave no sentence-order example: none of its {documents_read} documents has two "
                "sentences (ALBERT learns the order of consecutive sentences of one document, and each line of a "
                "text file is one document: put each document's sentences on one line, or use .jsonl with a text "
                "field per document)"
            )
        target = folder if folder is not None else Path(scratch) / "examples"
        _assemble(parts, target)
        examples, tokens = sum(part["examples"] for part in parts), sum(part["tokens"] for part in parts)
        logger.info(f"built {examples:,} SOP examples ({tokens:,} tokens) from {documents_read:,} documents")
        return open_examples(target, in_memory=folder is None)


def _batched(items: Iterable[str], size: int) -> Iterator[List[str]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _tick(progress, value):
    progress.update()
    return value


def _write_npy_header(stream, dtype, length: int) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_1_0(stream, header)


def _assemble(parts: List[dict], folder: Path) -> None:
    """Append the shards' arrays, in shard order, to one .npy file per array (written through a file, never held
    whole), then mark the folder complete."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = sum(part["tokens"] for part in parts)
    examples = sum(part["examples"] for part in parts)
    lengths = {"tokens": tokens, "offsets": examples + 1, "first_segment": examples, "sentence_order_label": examples}
    streams = {name: (folder / f"{name}.npy").open("wb") for name in EXAMPLE_ARRAYS}
    try:
        for name, stream in streams.items():
            _write_npy_header(stream, EXAMPLE_ARRAYS[name], lengths[name])
        streams["offsets"].write(np.zeros(1, dtype=np.int64).tobytes())
        base = 0
        for part in parts:
            shard = {name: np.load(f"{part['path']}-{name}.npy") for name in ("tokens", "lengths", "first", "labels")}
            streams["tokens"].write(shard["tokens"].tobytes())
            ends = base + np.cumsum(shard["lengths"], dtype=np.int64)
            streams["offsets"].write(ends.tobytes())
            base = int(ends[-1]) if len(ends) else base
            streams["first_segment"].write(shard["first"].tobytes())
            streams["sentence_order_label"].write(shard["labels"].tobytes())
    finally:
        for stream in streams.values():
            stream.close()
    (folder / COMPLETE_MARKER).write_text(json.dumps({"examples": examples, "tokens": tokens}) + "\n")


def open_examples(folder: Path, in_memory: bool = False) -> Dict[str, np.ndarray]:
    """The stored example arrays, memory-mapped (read-only); a missing, incomplete or inconsistent folder raises."""
    facts = json.loads((folder / COMPLETE_MARKER).read_text())
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode=None if in_memory else "r") for name in EXAMPLE_ARRAYS}
    wrong = [name for name, dtype in EXAMPLE_ARRAYS.items() if arrays[name].dtype != dtype or arrays[name].ndim != 1]
    count = facts["examples"]
    if (
        wrong
        or len(arrays["offsets"]) != count + 1
        or len(arrays["first_segment"]) != count
        or len(arrays["sentence_order_label"]) != count
        or len(arrays["tokens"]) != facts["tokens"]
        or int(arrays["offsets"][-1]) != facts["tokens"]
    ):
        raise ValueError(f"the example arrays in {folder} do not fit together")
    return arrays


def load_or_build_example_arrays(folder: Path, build: Callable[[Path], object]) -> Dict[str, np.ndarray]:
    """The example arrays stored in ``folder``, or ``build(temporary_folder)`` first (renamed into place when
    complete, so peers building the same cache at once never read a half-written one). A folder that cannot be
    read (an interrupted copy, a disk error, another program's files under its name) is derived data: it is
    rebuilt, with one warning."""
    if folder.exists():
        try:
            return open_examples(folder)
        except Exception as error:  # whatever a damaged folder raises: the inputs are still there
            logger.warning(f"the cached examples {folder} are unreadable ({type(error).__name__}): rebuilding them")
            shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        build(temporary)
        try:
            temporary.rename(folder)
        except OSError:  # another peer's build got there first: theirs is the same data
            if not folder.exists():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return open_examples(folder)


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
        examples: Dict[str, np.ndarray],
        ids: SpecialIds,
        mlm_probability: float,
        seed: int,
        max_seq_length: int,
        folder: Optional[Path] = None,
    ):
        """``examples``: what :func:`build_examples` returns; ``folder``: where they are stored, if they are (a
        copy of this dataset in another process then maps the files instead of receiving the arrays)."""
        self.examples = {name: np.asarray(array) for name, array in examples.items()}
        self.ids, self.mlm_probability, self.seed = ids, mlm_probability, seed
        self.max_seq_length, self.folder = max_seq_length, folder

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.folder is not None:
            del state["examples"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if "examples" not in state:
            self.examples = open_examples(self.folder)

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
            input_ids[row, : end - start] = torch.from_numpy(tokens[start:end].astype(np.int64))
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
            "sentence_order_label": torch.from_numpy(
                self.examples["sentence_order_label"][index.numpy()].astype(np.int64)
            ),
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
