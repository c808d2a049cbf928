"""ALBERT's tokenizer: a Unigram model trained with the shared text pieces (``common.text.tokenizer``), with
ALBERT's special tokens and ``[CLS] A [SEP] B [SEP]`` pairs, or a hub tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Sequence

from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from common.text import tokenizer as shared
from common.text.tokenizer import TokenizerSpec, as_transformers, new_tokenizer, train_pieces

SPECIAL_TOKENS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
ROLES = (
    ("pad_token", "<pad>"),
    ("unk_token", "<unk>"),
    ("cls_token", "[CLS]"),
    ("sep_token", "[SEP]"),
    ("mask_token", "[MASK]"),
)
# part of every trained tokenizer's cache key: bump when training gives different ids, so caches are rebuilt
TOKENIZER_FORMAT_VERSION = 2


def albert_spec(vocab_size: int) -> TokenizerSpec:
    return TokenizerSpec("unigram", vocab_size, tuple(SPECIAL_TOKENS), ROLES)


def train_unigram_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """ALBERT-style tokenizer: NFKC + lowercase, Metaspace pieces, ``[CLS] A [SEP] B [SEP]`` pairs."""
    spec = albert_spec(vocab_size)
    return train_unigram(new_tokenizer(spec), texts, vocab_size)


def train_unigram(
    tokenizer: Tokenizer,
    texts: Iterable[str],
    vocab_size: int,
    model_input_names: Sequence[str] = PreTrainedTokenizerFast.model_input_names,
) -> PreTrainedTokenizerFast:
    """Train a configured Unigram ``tokenizer`` (normaliser, pre-tokenizer, decoder set) with ALBERT's special
    tokens and ``[CLS] A [SEP] B [SEP]`` pairs; return it as a transformers tokenizer."""
    spec = albert_spec(vocab_size)
    tokenizer = train_pieces(tokenizer, texts, spec)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return as_transformers(tokenizer, spec, model_input_names)


def load_or_train_tokenizer(
    name: str,
    texts_factory: Callable[[], Iterable[str]],
    vocab_size: int,
    cache_dir: Path,
    train: Callable[[Iterable[str], int], PreTrainedTokenizerFast] = train_unigram_tokenizer,
    instead: str = "the hub is unreachable here; pass a local tokenizer folder or task.tokenizer=train",
) -> PreTrainedTokenizerFast:
    """``common.text.tokenizer.load_or_train_tokenizer``, training ALBERT's Unigram tokenizer by default."""
    return shared.load_or_train_tokenizer(name, texts_factory, vocab_size, cache_dir, train, instead)
