"""Downstream fine-tuning: substitute task construction, checkpoint loading, and end-to-end runs on small splits."""

import argparse
from dataclasses import replace

import pytest
import torch

from albert.sahajbert.downstream import (
    METRIC,
    FinetuneSettings,
    Splits,
    build_classifier,
    finetune_one_seed,
    load_task,
    mention_examples,
    summarise,
)
from albert.task import build_model
from albert.tokenizer import train_unigram_tokenizer
from tests.helpers import small_albert_config

TINY = small_albert_config()
SETTINGS = FinetuneSettings(
    epochs=2, batch_size=16, learning_rate=3e-3, max_length=32, max_train_examples=96, max_eval_examples=48
)


@pytest.fixture(scope="module")
def topic_splits() -> Splits:
    kind, splits = load_task("wiki_topic", seed=0)
    assert METRIC[kind] == "accuracy"  # one topic per text
    return splits


@pytest.fixture(scope="module")
def mention_splits() -> Splits:
    kind, splits = load_task("wiki_mentions", seed=0)
    assert METRIC[kind] == "seqeval_f1"  # one tag per word
    return splits


@pytest.fixture(scope="module")
def tokenizer(topic_splits):
    torch.set_num_threads(1)
    return train_unigram_tokenizer((text for text, _ in topic_splits.train[:300]), TINY.vocab_size)


def test_settings_take_the_options_a_command_line_names_and_defaults_for_the_rest():
    arguments = argparse.Namespace(epochs=2, learning_rate=3e-3, seeds=5, max_train_examples=None)
    settings = FinetuneSettings.from_arguments(arguments, max_length=16)
    assert settings == FinetuneSettings(epochs=2, learning_rate=3e-3, max_length=16)


def test_link_anchors_become_mention_tags():
    markup = (
        "'''Alaska''' is a [[U.S. state|state of the US]] near [[Canada]]. [[File:Map.png|a map]] "
        "It has many bears and also a lot of snow in winter."
    )
    ((words, tags),) = mention_examples(markup)
    tagged = [(word, tag) for word, tag in zip(words, tags) if tag]
    assert tagged == [("state", 1), ("of", 2), ("the", 2), ("US", 2), ("Canada", 1)]
    assert words[0] == "Alaska" and "Map" not in words


def test_substitute_splits_are_disjoint_and_labelled(topic_splits, mention_splits):
    assert len(topic_splits.labels) == 12 and len(topic_splits.train) > 5000
    train_texts = {text for text, _ in topic_splits.train}
    assert not train_texts & {text for text, _ in topic_splits.test}
    assert mention_splits.labels == ["O", "B-LINK", "I-LINK"]
    assert sum(tag == 1 for _, tags in mention_splits.train for tag in tags) > 1000


def test_pretrained_encoder_weights_are_loaded():
    pretrained = build_model(TINY, TINY.vocab_size)
    model = build_classifier("sequence", pretrained.config, 5, pretrained.state_dict())
    assert torch.equal(
        model.albert.embeddings.word_embeddings.weight, pretrained.albert.embeddings.word_embeddings.weight
    )
    wrong_shape = replace(TINY, hidden_size=64, num_attention_heads=2, intermediate_size=64)
    with pytest.raises(RuntimeError):
        build_classifier("sequence", pretrained.config, 5, build_model(wrong_shape, TINY.vocab_size).state_dict())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_finetune_end_to_end_on_a_small_split(kind, topic_splits, mention_splits, tokenizer):
    splits = topic_splits if kind == "sequence" else mention_splits
    model_config = build_model(TINY, TINY.vocab_size).config
    runs = [finetune_one_seed(kind, splits, tokenizer, model_config, None, SETTINGS, seed) for seed in range(2)]
    for run in runs:
        assert 0.0 <= run["test"] <= 1.0 and run["epoch"] in (0, 1) and run["train_examples"] == 96
    summary = summarise(runs)
    assert summary["seeds"] == 2 and summary["test_std"] >= 0.0
    if kind == "sequence":  # different seeds give different models
        assert runs[0]["validation"] != runs[1]["validation"] or runs[0]["test"] != runs[1]["test"]
