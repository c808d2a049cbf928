"""The shared text pieces: tokenizers trained the same way give the same ids, are trained once per content, and
token blocks keep the dataset protocol."""

import pytest
import torch

from common.errors import DataError
from common.task import SAMPLE_IDS
from common.text.blocks import BlockDataset, build_blocks
from common.text.corpus import (
    OFFLINE_WIKIPEDIA,
    iter_documents,
    iter_hub_or_local_lines,
    load_documents,
    load_hub_or_local_text,
)
from common.text.tokenizer import (
    END_OF_TEXT,
    TokenizerSpec,
    load_or_train_tokenizer,
    shared_tokenizer_folder,
    train_tokenizer,
)

UNIGRAM = TokenizerSpec("unigram", 600, (END_OF_TEXT, "<unk>"), (("eos_token", END_OF_TEXT), ("unk_token", "<unk>")))


@pytest.fixture(scope="module")
def documents():
    return load_documents(OFFLINE_WIKIPEDIA, None, 300)


@pytest.mark.parametrize("spec", [TokenizerSpec("bpe", 600), UNIGRAM], ids=["bpe", "unigram"])
def test_two_trainings_give_the_same_ids_with_the_special_tokens_first(documents, spec):
    first, second = (train_tokenizer(documents, spec) for _ in range(2))
    ids = list(range(len(first)))
    assert len(first) == len(second) <= 600
    assert first.convert_ids_to_tokens(ids) == second.convert_ids_to_tokens(ids)
    assert first.convert_ids_to_tokens(ids)[: len(spec.special_tokens)] == list(spec.special_tokens)
    assert first.eos_token == END_OF_TEXT and first.eos_token_id == 0
    assert first(documents[:20])["input_ids"] == second(documents[:20])["input_ids"]


def test_an_identical_tokenizer_is_trained_once_whatever_the_task(documents, tmp_path):
    spec = TokenizerSpec("bpe", 600)
    folder = shared_tokenizer_folder(tmp_path, (OFFLINE_WIKIPEDIA, None, 300), spec)
    assert folder == shared_tokenizer_folder(tmp_path, (OFFLINE_WIKIPEDIA, None, 300), TokenizerSpec("bpe", 600))
    assert folder != shared_tokenizer_folder(tmp_path, (OFFLINE_WIKIPEDIA, None, 300), UNIGRAM)
    assert folder != shared_tokenizer_folder(tmp_path, (OFFLINE_WIKIPEDIA, None, 400), spec)
    trained = load_or_train_tokenizer(
        "train", lambda: documents, 600, folder, lambda texts, _: train_tokenizer(texts, spec)
    )

    def must_not_train(*_):
        raise AssertionError("trained again although the cache holds the same tokenizer")

    cached = load_or_train_tokenizer("train", lambda: documents, 600, folder, must_not_train)
    assert cached.get_vocab() == trained.get_vocab()
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(DataError, match="model must be one of"):
        TokenizerSpec("wordpiece")


def test_blocks_join_documents_with_the_end_of_text_token_and_keep_the_protocol(documents):
    tokenizer = train_tokenizer(documents, TokenizerSpec("bpe", 600))
    blocks = build_blocks(documents[:50], tokenizer, 32, tokenizer.eos_token_id)["input_ids"]
    expected = [token for ids in tokenizer(documents[:50])["input_ids"] for token in [*ids, tokenizer.eos_token_id]]
    assert blocks.shape[1] == 32 and blocks.flatten().tolist() == expected[: blocks.numel()]
    dataset = BlockDataset({"input_ids": blocks})
    plan = dataset.plan(stream_seed=7, batch_size=4)
    entries = [next(plan) for _ in range(len(dataset) // 4 + 2)]  # into the second pass
    assert entries == [entry for entry, _ in zip(dataset.plan(stream_seed=7, batch_size=4), entries)]
    first_pass = [sample for ids, pass_index in entries if pass_index == 0 for sample in ids]
    assert sorted(first_pass) == sorted(set(first_pass)) and {entry[1] for entry in entries} == {0, 1}
    batch = dataset.batch(entries[0][0], entries[0][1])
    assert batch[SAMPLE_IDS].tolist() == entries[0][0]
    assert torch.equal(batch["input_ids"], blocks[entries[0][0]])


def test_text_files_are_streamed_as_the_datasets_text_builder_reads_them(tmp_path):
    # the streamed reader replaces the datasets builder for .txt corpora: a different split would give other
    # documents, so other examples and tokenizers, than peers reading the same file with the builder
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(
        "= Title =\r\n\r\nFirst line.\rSecond\u2028same line\x0c too.\n\n = = Part = = \nLast, no newline".encode()
    )
    (folder / "b.txt").write_text("  \nb's only line\n")
    assert list(iter_hub_or_local_lines(str(folder), None)) == load_hub_or_local_text(str(folder), None)
    for layout in ("line", "wikitext_article"):
        assert list(iter_documents(str(folder), None, None, layout)) == load_documents(str(folder), None, None, layout)
    assert list(iter_documents(str(folder), None, 2)) == load_documents(str(folder), None, None)[:2]
    (folder / "c.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match="c.txt is not UTF-8 text"):
        list(iter_documents(str(folder), None, None))
