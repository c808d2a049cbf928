"""Tokenizers trained offline with ``tokenizers`` (byte-level BPE or Unigram, with the special tokens a task
names), cached by what they were trained on, or loaded from the hub or a local folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Tuple

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.errors import DataError
from common.text.cache import cache_key

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"
# part of a shared tokenizer's cache key: bump when training gives other ids for the same spec and texts
FORMAT_VERSION = 1
MODELS = ("bpe", "unigram")


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything besides the texts that decides a trained tokenizer's ids (so, with the corpus, its cache key).

    ``model``: ``bpe`` is GPT-2's byte-level BPE (any text encodes, no unknown token, case kept); ``unigram`` is
    SentencePiece-style pieces of NFKC-normalised, lowercased text (it then needs an unknown token).
    ``special_tokens`` take the first ids, in this order. ``roles`` name them for transformers
    (``(("eos_token", "<|endoftext|>"), ...)``: eos, pad, unk, cls, sep, mask, bos)."""

    model: str = "bpe"
    vocab_size: int = 4000
    special_tokens: Tuple[str, ...] = (END_OF_TEXT,)
    roles: Tuple[Tuple[str, str], ...] = (("eos_token", END_OF_TEXT), ("pad_token", END_OF_TEXT))

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise DataError(f"tokenizer model must be one of {MODELS}, not {self.model!r}")
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise DataError(f"special tokens repeat: {self.special_tokens}")
        unknown = [token for _, token in self.roles if token not in self.special_tokens]
        if unknown:
            raise DataError(f"tokens given a role but not listed as special tokens: {unknown}")
        if self.model == "unigram" and "unk_token" not in dict(self.roles):
            raise DataError("a unigram tokenizer needs an unk_token among its roles")


def new_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """An untrained tokenizer of ``spec.model`` with its normaliser, pre-tokenizer and decoder."""
    if spec.model == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer


def train_pieces(tokenizer: Tokenizer, texts: Iterable[str], spec: TokenizerSpec) -> Tokenizer:
    """Train a configured ``tokenizer`` (``new_tokenizer`` or one set up like it) on ``texts``, ids in stable order."""
    show = sys.stderr.isatty()  # the Rust trainer's own progress bar, when someone watches a terminal
    if spec.model == "bpe":
        trainer = trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=list(spec.special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show,
        )
    else:
        trainer = trainers.UnigramTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=list(spec.special_tokens),
            unk_token=dict(spec.roles)["unk_token"],
            show_progress=show,
        )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.model = pieces_in_stable_order(tokenizer, spec)
    return tokenizer


def pieces_in_stable_order(tokenizer: Tokenizer, spec: TokenizerSpec) -> models.Model:
    """The trained model with its pieces renumbered: special tokens first, then the rest by code point.

    The Rust trainers count in hash maps whose seeds change from process to process, so two trainings on the same
    texts may number the same pieces differently (Unigram: by scores that differ in their last bits; about 6 % of
    the ids moved). A volunteer who trains the tokenizer on its own machine would then feed the swarm's
    embeddings other tokens. Numbered by the piece itself, the ids depend only on which pieces were kept."""
    model = json.loads(tokenizer.to_str())["model"]
    if spec.model == "unigram":
        scores = dict(model["vocab"])
        vocab = [(piece, scores.pop(piece)) for piece in spec.special_tokens] + sorted(scores.items())
        unk_id = spec.special_tokens.index(dict(spec.roles)["unk_token"])
        return models.Unigram(vocab, unk_id=unk_id, byte_fallback=model.get("byte_fallback", False))
    pieces = set(model["vocab"]) - set(spec.special_tokens)
    order = [*spec.special_tokens, *sorted(pieces)]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    return models.BPE({piece: index for index, piece in enumerate(order)}, merges)


def as_transformers(
    tokenizer: Tokenizer,
    spec: TokenizerSpec,
    model_input_names: Sequence[str] = PreTrainedTokenizerFast.model_input_names,
) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_input_names=list(model_input_names), **dict(spec.roles)
    )


def train_tokenizer(texts: Iterable[str], spec: TokenizerSpec) -> PreTrainedTokenizerFast:
    """A new ``spec`` tokenizer trained on ``texts``, as a transformers tokenizer."""
    return as_transformers(train_pieces(new_tokenizer(spec), texts, spec), spec)


def tokenizer_fingerprint(tokenizer: Optional[PreTrainedTokenizerFast]) -> str:
    """A digest of the pieces in id order (what the model's inputs mean); "" for a peer without a tokenizer."""
    if tokenizer is None:
        return ""
    return cache_key(*tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def shared_tokenizer_folder(cache_root: Path, corpus_key: Sequence[object], spec: TokenizerSpec) -> Path:
    """Where a tokenizer of ``spec`` trained on the corpus named by ``corpus_key`` (its source and the documents
    kept) is cached: every task asking for the same one, under any task name, finds it there."""
    key = cache_key(FORMAT_VERSION, *corpus_key, spec.model, spec.vocab_size, spec.special_tokens, spec.roles)
    return Path(cache_root) / f"tokenizer-{spec.model}-{key}"


def load_or_train_tokenizer(
    name: str,
    texts_factory: Callable[[], Iterable[str]],
    vocab_size: int,
    cache_dir: Path,
    train: Callable[[Iterable[str], int], PreTrainedTokenizerFast],
    instead: str = "the hub is unreachable here; pass a local tokenizer folder or task.tokenizer=train",
) -> PreTrainedTokenizerFast:
    """``name == "train"``: ``train(texts_factory(), vocab_size)`` once, cached in ``cache_dir``; otherwise a hub name
    or local folder, and a failure to load it is one DataError line that says what to do ``instead``."""
    if name != "train":
        try:
            return PreTrainedTokenizerFast.from_pretrained(name)
        except Exception as error:  # hub and file errors come in many types
            detail = " ".join(str(error).split())[:200]
            raise DataError(f"cannot load tokenizer {name!r}: {detail} -- {instead}") from None
    cache_dir = Path(cache_dir)
    if (cache_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(cache_dir))
    logger.info(f"training a tokenizer (vocab {vocab_size}) on the corpus; cached in {cache_dir}")
    tokenizer = train(texts_factory(), vocab_size)
    # written beside the cache, then renamed: peers training the same tokenizer at once never read half a folder
    staging = cache_dir.with_name(f"{cache_dir.name}.{os.getpid()}.tmp")
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(cache_dir)
    except OSError:  # another peer's identical copy is already in place
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer
