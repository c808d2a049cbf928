"""Downstream evaluation of a pretrained ALBERT (sahajBERT's protocol): fine-tune on token classification (NER,
seqeval F1) and sequence classification (accuracy) with several seeds, select the epoch by the validation
metric, report the test metric of the selected epoch as mean +- std over seeds.

Full scale: WikiANN-bn (hub ``wikiann``/``bn``) and IndicGLUE ``sna.bn`` (hub ``ai4bharat/indic_glue``).
Offline substitutes (installed offline; English, so they evaluate the pipeline, not Bengali ability):
  * ``wiki_topic``: the topic label (12 classes) of 10,033 English Wikipedia lead sections;
  * ``wiki_mentions``: link-anchor mention tagging (B-LINK/I-LINK/O) on gensim's test Wikipedia dump, built the
    way WikiANN was (anchors of ``[[target|anchor]]`` links are the tagged spans).
"""

from __future__ import annotations

import bz2
import importlib.util
import logging
import math
import random
import re
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

from albert.corpus import load_hub_dataset, offline_wikipedia_articles
from common.errors import DataError
from common.seeding import stable_seed

logger = logging.getLogger(__name__)

TOKEN_TASKS = {"wikiann_bn": ("wikiann", "bn"), "wiki_mentions": None}
SEQUENCE_TASKS = {"sna_bn": ("ai4bharat/indic_glue", "sna.bn"), "wiki_topic": None}
METRIC = {"token": "seqeval_f1", "sequence": "accuracy"}  # what a task of each kind is scored by
MENTION_TAGS = ["O", "B-LINK", "I-LINK"]
GENSIM_WIKI_DUMP = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LINK = re.compile(r"\[\[([^\[\]|]+)(?:\|([^\[\]]*))?\]\]")
OPEN_MENTION, CLOSE_MENTION = "\u27e6", "\u27e7"  # survive gensim's markup filter, absent from the dump
WORD = re.compile(rf"{OPEN_MENTION}|{CLOSE_MENTION}|\w+|[^\w\s]")
WORDS_PER_EXAMPLE = 48


@dataclass
class Splits:
    """``train``/``validation``/``test`` lists of examples and the label names."""

    train: list
    validation: list
    test: list
    labels: List[str]


def split_three(
    items: list, seed: int, validation_share: float = 0.15, test_share: float = 0.15
) -> Tuple[list, list, list]:
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    n_validation, n_test = int(len(shuffled) * validation_share), int(len(shuffled) * test_share)
    return shuffled[n_validation + n_test :], shuffled[:n_validation], shuffled[n_validation : n_validation + n_test]


def _hub_splits(name: str, config_name: str, text_fields: Sequence[str]) -> dict:
    loaded = load_hub_dataset(name, config_name, "use the offline substitutes (wiki_mentions, wiki_topic)")
    missing = [field for field in text_fields if field not in loaded["train"].column_names]
    if missing:
        raise DataError(f"{name} ({config_name}) lacks fields {missing}")
    return loaded


def gensim_wiki_dump() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("gensim is not installed: pip install gensim==4.4.0 (its test data is the substitute NER set)")
    path = Path(spec.submodule_search_locations[0]) / GENSIM_WIKI_DUMP
    if not path.is_file():
        raise DataError(f"gensim's test Wikipedia dump is missing: {path}")
    return path


def mention_examples(article_markup: str) -> List[Tuple[List[str], List[int]]]:
    """Words and B/I/O tags of one article: the anchors of article links are mentions."""
    from gensim.corpora.wikicorpus import filter_wiki

    def mark(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2)
        if ":" in target:  # File:, Category:, interlanguage links are not mentions
            return match.group(0)
        return f" {OPEN_MENTION}{anchor if anchor is not None else target}{CLOSE_MENTION} "

    text = re.sub(r"'{2,}", "", filter_wiki(LINK.sub(mark, article_markup)))  # bold/italic quote marks
    words, tags, inside, first = [], [], False, False
    for token in WORD.findall(text):
        if token == OPEN_MENTION:
            inside, first = True, True
        elif token == CLOSE_MENTION:
            inside = False
        else:
            words.append(token)
            tags.append(0 if not inside else (1 if first else 2))
            first = False
    return [
        (words[start : start + WORDS_PER_EXAMPLE], tags[start : start + WORDS_PER_EXAMPLE])
        for start in range(0, len(words), WORDS_PER_EXAMPLE)
        if len(words[start : start + WORDS_PER_EXAMPLE]) > 4
    ]


def load_token_task(name: str, seed: int) -> Splits:
    if name == "wiki_mentions":
        from gensim.corpora.wikicorpus import extract_pages

        with bz2.BZ2File(gensim_wiki_dump()) as dump:
            articles = [
                text
                for _title, text, _id in extract_pages(dump, filter_namespaces=("0",))
                if not text.lstrip().upper().startswith("#REDIRECT")
            ]
        train, validation, test = split_three(articles, seed)  # split by article: no text shared across splits
        expand = lambda group: [example for article in group for example in mention_examples(article)]  # noqa: E731
        return Splits(expand(train), expand(validation), expand(test), MENTION_TAGS)
    if name not in TOKEN_TASKS:
        raise DataError(f"unknown token-classification task {name!r}: choose one of {sorted(TOKEN_TASKS)}")
    loaded = _hub_splits(*TOKEN_TASKS[name], text_fields=("tokens", "ner_tags"))
    labels = loaded["train"].features["ner_tags"].feature.names
    convert = lambda split: [(row["tokens"], row["ner_tags"]) for row in loaded[split]]  # noqa: E731
    return Splits(convert("train"), convert("validation"), convert("test"), labels)


def load_sequence_task(name: str, seed: int) -> Splits:
    if name == "wiki_topic":
        articles = offline_wikipedia_articles()
        labels = sorted({article["topic"] for article in articles})
        examples = [(article["text"], labels.index(article["topic"])) for article in articles]
        train, validation, test = split_three(examples, seed)
        return Splits(train, validation, test, labels)
    if name not in SEQUENCE_TASKS:
        raise DataError(f"unknown sequence-classification task {name!r}: choose one of {sorted(SEQUENCE_TASKS)}")
    loaded = _hub_splits(*SEQUENCE_TASKS[name], text_fields=("text", "label"))
    labels = loaded["train"].features["label"].names
    convert = lambda split: [(row["text"], row["label"]) for row in loaded[split]]  # noqa: E731
    return Splits(convert("train"), convert("validation"), convert("test"), labels)


def load_task(name: str, seed: int) -> Tuple[str, Splits]:
    """A downstream task's kind (``token`` or ``sequence``, the key of ``METRIC``) and its splits."""
    if name in TOKEN_TASKS:
        return "token", load_token_task(name, seed)
    return "sequence", load_sequence_task(name, seed)


def encode_tokens(tokenizer: PreTrainedTokenizerFast, examples, max_length: int) -> Dict[str, torch.Tensor]:
    """Word-level tags on each word's first piece; other pieces and specials are ignored (-100)."""
    encoded = tokenizer(
        [words for words, _ in examples],
        is_split_into_words=True,
        truncation=True,
        max_length=max_length,
        padding="max_length",
        return_tensors="pt",
    )
    labels = torch.full(encoded["input_ids"].shape, -100, dtype=torch.long)
    for row, (_, tags) in enumerate(examples):
        previous = None
        for column, word in enumerate(encoded.word_ids(row)):
            if word is not None and word != previous:
                labels[row, column] = tags[word]
            previous = word
    return {**encoded, "labels": labels}


def encode_sequences(tokenizer: PreTrainedTokenizerFast, examples, max_length: int) -> Dict[str, torch.Tensor]:
    encoded = tokenizer(
        [text for text, _ in examples],
        truncation=True,
        max_length=max_length,
        padding="max_length",
        return_tensors="pt",
    )
    return {**encoded, "labels": torch.tensor([label for _, label in examples], dtype=torch.long)}


@dataclass
class FinetuneSettings:
    epochs: int = 3
    batch_size: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    warmup_share: float = 0.1
    max_length: int = 64
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None

    @classmethod
    def from_arguments(cls, arguments, **given) -> "FinetuneSettings":
        """The settings a parsed command line names (its options spelled like the fields), then ``given``; the
        rest keep their defaults."""
        names = {field.name for field in fields(cls)}
        return cls(**{name: value for name, value in vars(arguments).items() if name in names}, **given)

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.learning_rate <= 0 or self.max_length < 8:
            raise ValueError("finetune settings: epochs, batch_size >= 1, learning_rate > 0, max_length >= 8")


def build_classifier(
    kind: str,
    model_config: AlbertConfig,
    num_labels: int,
    pretrained_state: Optional[dict],
    pretrained_model: Optional[str] = None,
) -> torch.nn.Module:
    """A fresh head on the pretrained encoder: ``albert.*`` weights of an AlbertForPreTraining checkpoint, or any
    Hugging Face model (an exported folder or a hub name such as xlm-roberta-large) given as ``pretrained_model``."""
    if pretrained_model is not None:
        auto = AutoModelForTokenClassification if kind == "token" else AutoModelForSequenceClassification
        try:
            return auto.from_pretrained(pretrained_model, num_labels=num_labels)
        except Exception as error:  # a missing folder, an unreachable hub, a model with no such head
            raise DataError(f"cannot load model {pretrained_model!r}: {' '.join(str(error).split())[:200]}") from None
    settings = {key: value for key, value in model_config.to_dict().items() if key not in ("id2label", "label2id")}
    config = AlbertConfig(**{**settings, "num_labels": num_labels, "classifier_dropout_prob": 0.1})
    model = (AlbertForTokenClassification if kind == "token" else AlbertForSequenceClassification)(config)
    if pretrained_state is not None:
        encoder = {key: value for key, value in pretrained_state.items() if key.startswith("albert.")}
        result = model.load_state_dict(encoder, strict=False)
        missing_encoder = [
            key for key in result.missing_keys if key.startswith("albert.") and not key.startswith("albert.pooler")
        ]
        if missing_encoder or not encoder:
            raise DataError(f"the checkpoint does not match the model config: missing {missing_encoder[:3]}")
    return model


def _metric(kind: str, model, data: Dict[str, torch.Tensor], labels: List[str], batch_size: int) -> float:
    model.eval()
    predictions, targets = [], []
    with torch.no_grad():
        for start in range(0, len(data["labels"]), batch_size):
            batch = {key: value[start : start + batch_size] for key, value in data.items()}
            logits = model(**{key: value for key, value in batch.items() if key != "labels"}).logits
            predictions.append(logits.argmax(-1))
            targets.append(batch["labels"])
    predicted, gold = torch.cat(predictions), torch.cat(targets)
    if kind == "sequence":
        return float((predicted == gold).float().mean())
    from seqeval.metrics import f1_score

    keep = gold != -100
    as_tags = lambda matrix: [[labels[i] for i in row[mask].tolist()] for row, mask in zip(matrix, keep)]  # noqa: E731
    return float(f1_score(as_tags(gold), as_tags(predicted)))


def finetune_one_seed(
    kind: str,
    splits: Splits,
    tokenizer,
    model_config: AlbertConfig,
    pretrained_state: Optional[dict],
    settings: FinetuneSettings,
    seed: int,
    pretrained_model: Optional[str] = None,
) -> dict:
    """Train with ``seed``; after each epoch measure validation, keep the test score of the best epoch."""
    torch.manual_seed(stable_seed("finetune", seed))
    encode = encode_tokens if kind == "token" else encode_sequences
    train_examples = splits.train[: settings.max_train_examples]
    train = encode(tokenizer, train_examples, settings.max_length)
    validation = encode(tokenizer, splits.validation[: settings.max_eval_examples], settings.max_length)
    test = encode(tokenizer, splits.test[: settings.max_eval_examples], settings.max_length)
    model = build_classifier(kind, model_config, len(splits.labels), pretrained_state, pretrained_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    steps_per_epoch = math.ceil(len(train["labels"]) / settings.batch_size)
    total = steps_per_epoch * settings.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(settings.warmup_share * total), total)
    generator = torch.Generator().manual_seed(stable_seed("finetune-order", seed))
    best = {"validation": -1.0, "test": float("nan"), "epoch": -1}
    started = time.monotonic()
    for epoch in range(settings.epochs):
        model.train()
        order = torch.randperm(len(train["labels"]), generator=generator)
        for start in range(0, len(order), settings.batch_size):
            index = order[start : start + settings.batch_size]
            loss = model(**{key: value[index] for key, value in train.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        validation_score = _metric(kind, model, validation, splits.labels, settings.batch_size)
        if validation_score > best["validation"]:
            best = {
                "validation": validation_score,
                "epoch": epoch,
                "test": _metric(kind, model, test, splits.labels, settings.batch_size),
            }
        logger.info(
            f"seed {seed} epoch {epoch + 1}/{settings.epochs}: loss {loss.item():.3f}, validation "
            f"{validation_score:.4f} (best {best['validation']:.4f} at epoch {best['epoch'] + 1}), "
            f"{time.monotonic() - started:.0f} s"
        )
    return {"seed": seed, **best, "train_examples": len(train["labels"]), "seconds": time.monotonic() - started}


def summarise(runs: List[dict]) -> dict:
    scores = [run["test"] for run in runs]
    return {
        "test_mean": statistics.mean(scores),
        "test_std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
        "seeds": len(scores),
        "runs": runs,
    }
