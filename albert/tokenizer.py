"""Tokenizers: a Unigram (SentencePiece-style) model trained offline with ``tokenizers``, or a hub tokenizer."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from common.errors import DataError

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
# part of every trained tokenizer's cache key: bump when training gives different ids, so caches are rebuilt
TOKENIZER_FORMAT_VERSION = 2


def train_unigram_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """ALBERT-style tokenizer: NFKC + lowercase, Metaspace pieces, ``[CLS] A [SEP] B [SEP]`` pairs."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return train_unigram(tokenizer, texts, vocab_size)


def train_unigram(
    tokenizer: Tokenizer,
    texts: Iterable[str],
    vocab_size: int,
    model_input_names: Sequence[str] = PreTrainedTokenizerFast.model_input_names,
) -> PreTrainedTokenizerFast:
    """Train a configured Unigram ``tokenizer`` (normaliser, pre-tokenizer, decoder set) with ALBERT's special
    tokens and ``[CLS] A [SEP] B [SEP]`` pairs; return it as a transformers tokenizer."""
    # the Rust trainer's own progress bar, when someone watches a terminal (not in peer logs)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, unk_token="<unk>", show_progress=sys.stderr.isatty()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.model = pieces_in_stable_order(tokenizer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        unk_token="<unk>",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=list(model_input_names),
    )


def pieces_in_stable_order(tokenizer: Tokenizer) -> models.Unigram:
    """The trained Unigram model with its pieces renumbered: special tokens first, then the rest by code point.

    The Rust trainer counts in hash maps whose seeds change from process to process, so two trainings on the same
    texts give the same pieces with slightly different scores (in the last bits; by up to 2e-3 for the rare
    characters it appends at the end). Numbered by score, as trained, about 6 % of the ids then differ between two
    machines, and a volunteer who trains the tokenizer on its own machine would feed the swarm's embeddings other
    tokens. Numbered by the piece itself, the ids depend only on which pieces were kept."""
    model = json.loads(tokenizer.to_str())["model"]
    scores = dict(model["vocab"])
    specials = [(piece, scores.pop(piece)) for piece in SPECIAL_TOKENS]
    vocab = specials + sorted(scores.items())
    return models.Unigram(vocab, unk_id=SPECIAL_TOKENS.index("<unk>"), byte_fallback=model.get("byte_fallback", False))


def load_or_train_tokenizer(
    name: str,
    texts_factory: Callable[[], Iterable[str]],
    vocab_size: int,
    cache_dir: Path,
    train: Callable[[Iterable[str], int], PreTrainedTokenizerFast] = train_unigram_tokenizer,
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
    if (cache_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(cache_dir))
    logger.info(f"training a Unigram tokenizer (vocab {vocab_size}) on the corpus")
    tokenizer = train(texts_factory(), vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(cache_dir))
    return tokenizer
