"""The sahajBERT tokenizer (the paper), built only from ``tokenizers`` components.

Normalisation, in order:
  1. NMT: drops control characters and maps the unusual spaces NMT data carries to a plain space.
  2. NFKC: compatibility composition (e.g. Bengali nukta forms such as U+09DC/U+09DD/U+09DF are decomposed to
     their base letter + nukta, so both spellings of "ড়" become the same sequence).
  3. Runs of whitespace collapse to one space.
  4. Bengali character homogenisation (one code point per symbol, as in the sahajBERT tokenizer):
       U+09E4 (reserved "Bengali danda") and U+007C "|" and U+09F7 "৷" (currency numerator four, widely typed
       as a danda) -> U+0964 "।" (the danda Unicode assigns to Bengali);
       U+09E5 (reserved "Bengali double danda") -> U+0965 "॥";
       an ASCII colon directly after a Bengali letter -> U+0983 "ঃ" (visarga, which it is typed in place of).
  5. Lowercase (affects Latin text mixed into Bengali; Bengali has no case).
Pre-tokenisation: Metaspace ("▁" marks word starts), then every digit on its own (Bengali digits ০-৯ count as
digits), then punctuation (including the danda) isolated. Pairs are ``[CLS] A [SEP] B [SEP]``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from albert.tokenizer import load_or_train_tokenizer, train_unigram

logger = logging.getLogger(__name__)

DANDA, DOUBLE_DANDA, VISARGA = "\u0964", "\u0965", "\u0983"
BENGALI_HOMOGENISATION = [  # (pattern, replacement); documented in the module docstring
    ("\u09e4", DANDA),
    ("\u09e5", DOUBLE_DANDA),
    ("|", DANDA),
    ("\u09f7", DANDA),
    (Regex(r"(?<=[\u0980-\u09ff]):"), VISARGA),
]


def bengali_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.Nmt(),
            normalizers.NFKC(),
            normalizers.Replace(Regex(r"\s+"), " "),
            *(normalizers.Replace(pattern, replacement) for pattern, replacement in BENGALI_HOMOGENISATION),
            normalizers.Lowercase(),
        ]
    )


def bengali_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )


def train_bengali_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A Unigram model trained on ``texts``; returned as a transformers tokenizer (``save_pretrained``-able)."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = bengali_normalizer()
    tokenizer.pre_tokenizer = bengali_pre_tokenizer()
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    wrapped = train_unigram(
        tokenizer, texts, vocab_size, model_input_names=["input_ids", "token_type_ids", "attention_mask"]
    )
    logger.info(f"trained a Bengali Unigram tokenizer with {tokenizer.get_vocab_size()} tokens")
    return wrapped


def load_or_train_bengali_tokenizer(
    name: str, texts_factory, vocab_size: int, cache_dir: Path
) -> PreTrainedTokenizerFast:
    """``name == "train"``: train on ``texts_factory()`` once (cached in ``cache_dir``); else a local folder or
    hub name (e.g. ``neuropark/sahajBERT``)."""
    return load_or_train_tokenizer(
        name,
        texts_factory,
        vocab_size,
        cache_dir,
        train=train_bengali_tokenizer,
        instead="pass a folder written by scripts/train_sahajbert_tokenizer.py or task.tokenizer=train",
    )
