"""sahajBERT's streamed, mixed data: Bengali Wikipedia and OSCAR-bn streamed with ``datasets``, interleaved
0.23 : 0.77, shuffled through a 10^4-document buffer with a per-peer seed, split into sentences on the danda,
and turned into SOP + MLM instances on the fly. Hub names and local files (.json/.jsonl/.parquet/.txt with a
``text`` field, e.g. from ``scripts/prepare_bengali_data.py``) go through the same code path."""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, List, Optional

import torch

from albert.data import SpecialIds, cache_key, create_sop_instances, mask_tokens, special_ids
from albert.sahajbert.tokenizer import load_or_train_bengali_tokenizer
from albert.tokenizer import TOKENIZER_FORMAT_VERSION
from common.errors import DataError
from common.seeding import stable_seed
from common.task import SAMPLE_IDS, Batch

if TYPE_CHECKING:  # imported where a stream is opened, so that peers of the other tasks skip its import time
    import datasets

logger = logging.getLogger(__name__)

BENGALI_STREAM = "bengali_stream"  # the value of task.corpus that selects this data path
SOURCE_COLUMN = "source_index"
SENTENCE_END = re.compile(r"(?<=[\u0964\u0965?!])\s+|\s*\n\s*")  # after a danda/double danda/?/!, or a line break
LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class StreamConfig:
    """``task.stream``: the mixed sources (used when ``task.corpus`` is ``bengali_stream``)."""

    sources: List[str] = field(default_factory=lambda: ["wikimedia/wikipedia", "oscar"])  # hub names or local paths
    source_configs: List[Optional[str]] = field(default_factory=lambda: ["20231101.bn", "unshuffled_deduplicated_bn"])
    probabilities: List[float] = field(default_factory=lambda: [0.23, 0.77])
    shuffle_buffer: int = 10_000
    tokenizer_training_documents: int = (
        20_000  # documents per source read to train the tokenizer (task.tokenizer=train)
    )

    def __post_init__(self) -> None:
        _require(len(self.sources) >= 1, "task.stream.sources must list at least one source")
        _require(
            len(self.source_configs) == len(self.sources),
            "task.stream.source_configs must have one entry (or null) per task.stream.sources entry",
        )
        _require(
            len(self.probabilities) == len(self.sources) and all(p > 0 for p in self.probabilities),
            "task.stream.probabilities must give one positive probability per source",
        )
        _require(abs(sum(self.probabilities) - 1.0) < 1e-6, "task.stream.probabilities must sum to 1")
        _require(self.shuffle_buffer >= 1, "task.stream.shuffle_buffer must be >= 1")
        _require(self.tokenizer_training_documents >= 1, "task.stream.tokenizer_training_documents must be >= 1")


def split_sentences(document: str) -> List[str]:
    """Bengali sentences end with the danda (।), the double danda (॥), '?' or '!'; line breaks also end one."""
    return [sentence.strip() for sentence in SENTENCE_END.split(document) if sentence.strip()]


def open_source(name: str, config_name: Optional[str]) -> datasets.IterableDataset:
    """One source as a streaming dataset with only its ``text`` column."""
    import datasets

    path = Path(name)
    try:
        if path.exists():
            files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.suffix in LOCAL_BUILDERS)
            if not files:
                raise DataError(f"no .txt/.json/.jsonl/.parquet files under {path}")
            if len({LOCAL_BUILDERS[p.suffix] for p in files}) > 1:
                raise DataError(f"mixed file types under {path}: keep one of .txt/.json(l)/.parquet per source")
            stream = datasets.load_dataset(
                LOCAL_BUILDERS[files[0].suffix], data_files=[str(p) for p in files], split="train", streaming=True
            )
        else:
            stream = datasets.load_dataset(name, config_name, split="train", streaming=True)
    except DataError:
        raise
    except Exception as error:  # hub/network/file errors come in many types
        detail = " ".join(str(error).split())[:200]
        raise DataError(
            f"cannot stream {name!r} ({config_name}): {detail} -- the hub is unreachable here; pass a "
            f"local copy (or scripts/prepare_bengali_data.py's output) in task.stream.sources"
        ) from None
    if stream.column_names is not None and "text" not in stream.column_names:
        raise DataError(f"source {name!r} has no 'text' field (fields: {stream.column_names})")
    return stream.select_columns(["text"])


def mixed_stream(config: StreamConfig, seed: int) -> datasets.IterableDataset:
    """Endless documents ``{"text", "source_index"}``: sources repeated, interleaved by probability, shuffled."""
    import datasets

    sources = [
        open_source(name, config_name)
        .map(lambda _example, index=index: {SOURCE_COLUMN: index})
        .repeat(None)  # an endless stream: a source that runs out starts over
        for index, (name, config_name) in enumerate(zip(config.sources, config.source_configs))
    ]
    mixed = datasets.interleave_datasets(
        sources, probabilities=list(config.probabilities), seed=seed, stopping_strategy="first_exhausted"
    )
    return mixed.shuffle(seed=seed, buffer_size=config.shuffle_buffer)


def tokenizer_training_texts(config: StreamConfig) -> Iterator[str]:
    """The first documents of every source (the tokenizer is trained once and cached, so order is stable)."""
    for name, config_name in zip(config.sources, config.source_configs):
        for example in islice(open_source(name, config_name), config.tokenizer_training_documents):
            yield example["text"]


class StreamingSopDataset:
    """SOP + MLM micro-batches built on the fly from the mixed stream (same batch keys as ``SopDataset``)."""

    def __init__(
        self,
        config: StreamConfig,
        tokenizer,
        max_seq_length: int,
        short_seq_probability: float,
        mlm_probability: float,
    ):
        self.config, self.tokenizer = config, tokenizer
        self.max_seq_length, self.short_seq_probability = max_seq_length, short_seq_probability
        self.mlm_probability = mlm_probability
        self.ids: SpecialIds = special_ids(tokenizer)

    def instances(self, stream_seed: int) -> Iterator[dict]:
        rng = random.Random(stable_seed(stream_seed, "sop"))
        for document in mixed_stream(self.config, seed=stable_seed(stream_seed, "mix") % 2**32):
            sentences = split_sentences(document["text"])
            if len(sentences) < 2:
                continue
            encoded = [ids for ids in self.tokenizer(sentences, add_special_tokens=False)["input_ids"] if ids]
            for instance in create_sop_instances(
                encoded, self.max_seq_length, self.short_seq_probability, rng, self.ids
            ):
                instance[SOURCE_COLUMN] = document[SOURCE_COLUMN]
                yield instance

    def stream(self, stream_seed: int, batch_size: int) -> Iterator[Batch]:
        """Endless micro-batches; a sample's id is unique per (peer stream, position) and seeds its masking."""
        instances = self.instances(stream_seed)
        produced = 0
        while True:
            chunk = list(islice(instances, batch_size))
            if len(chunk) < batch_size:
                raise DataError("the Bengali stream ended; sources are repeated, so they must be empty")
            sample_ids = [stable_seed(stream_seed, "sample", produced + row) for row in range(batch_size)]
            produced += batch_size
            columns = {
                name: torch.tensor([instance[name] for instance in chunk], dtype=torch.long)
                for name in ("input_ids", "token_type_ids", "attention_mask", "sentence_order_label", SOURCE_COLUMN)
            }
            corrupted, labels = [], []
            for row, sample_id in enumerate(sample_ids):
                generator = torch.Generator().manual_seed(stable_seed(sample_id, "mask"))
                masked, label = mask_tokens(
                    columns["input_ids"][row : row + 1],
                    columns["attention_mask"][row : row + 1],
                    self.ids,
                    self.mlm_probability,
                    generator,
                )
                corrupted.append(masked)
                labels.append(label)
            columns["input_ids"], columns["labels"] = torch.cat(corrupted), torch.cat(labels)
            columns[SAMPLE_IDS] = torch.tensor(sample_ids, dtype=torch.long)
            yield columns


def bengali_tokenizer_folder(task_config) -> Path:
    """Where the tokenizer trained on the stream's sources is cached (its name hashes what it was trained on)."""
    stream_config: StreamConfig = task_config.stream
    tokenizer_key = cache_key(
        TOKENIZER_FORMAT_VERSION,
        BENGALI_STREAM,
        stream_config.sources,
        stream_config.source_configs,
        stream_config.tokenizer_training_documents,
        task_config.vocab_size,
    )
    return Path(task_config.cache_dir) / f"bengali-tokenizer-{tokenizer_key}"


def build_streaming_dataset(task_config) -> tuple:
    """(tokenizer, dataset) for ``task.corpus: bengali_stream`` (``task_config`` is albert's TaskConfig)."""
    stream_config: StreamConfig = task_config.stream
    tokenizer = load_or_train_bengali_tokenizer(
        task_config.tokenizer,
        lambda: tokenizer_training_texts(stream_config),
        task_config.vocab_size,
        bengali_tokenizer_folder(task_config),
    )
    dataset = StreamingSopDataset(
        stream_config,
        tokenizer,
        task_config.max_seq_length,
        task_config.short_seq_probability,
        task_config.mlm_probability,
    )
    logger.info(
        f"Bengali stream: sources {stream_config.sources} mixed {stream_config.probabilities}, "
        f"shuffle buffer {stream_config.shuffle_buffer}, tokenizer of {len(tokenizer)} tokens"
    )
    return tokenizer, dataset
