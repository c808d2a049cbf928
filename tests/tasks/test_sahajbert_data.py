"""sahajBERT data path: the Bengali tokenizer's normalisation and pre-tokenisation, danda sentence splitting,
the 0.23 : 0.77 streaming mixer and on-the-fly SOP batches (on small fixture files of real Bengali strings)."""

from collections import Counter
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest
import torch

from albert.sahajbert.data import (
    SOURCE_COLUMN,
    StreamConfig,
    StreamingSopDataset,
    mixed_stream,
    split_sentences,
    tokenizer_training_texts,
)
from albert.sahajbert.tokenizer import (
    bengali_normalizer,
    bengali_pre_tokenizer,
    load_or_train_bengali_tokenizer,
    train_bengali_tokenizer,
)
from common.config import load_config
from common.errors import ConfigError, DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sahajbert"
FIXTURE_STREAM = StreamConfig(
    sources=[str(FIXTURES / "wikipedia_standin"), str(FIXTURES / "oscar_standin")],
    source_configs=[None, None],
    probabilities=[0.23, 0.77],
    shuffle_buffer=10_000,
    tokenizer_training_documents=24,
)


@pytest.fixture(scope="module")
def tokenizer():
    torch.set_num_threads(1)
    return train_bengali_tokenizer(tokenizer_training_texts(FIXTURE_STREAM), vocab_size=400)


def test_bengali_tokenizer_is_trained_once_then_read_from_its_cache_and_a_bad_name_says_what_to_pass(tmp_path):
    texts = list(tokenizer_training_texts(FIXTURE_STREAM))
    trained = load_or_train_bengali_tokenizer("train", lambda: texts, 400, tmp_path / "cache")
    cached = load_or_train_bengali_tokenizer("train", lambda: pytest.fail("trained twice"), 400, tmp_path / "cache")
    assert cached.get_vocab() == trained.get_vocab()
    assert cached("আমি বই পড়ি।")["input_ids"] == trained("আমি বই পড়ি।")["input_ids"]
    with pytest.raises(DataError, match="cannot load tokenizer .* scripts/train_sahajbert_tokenizer.py"):
        load_or_train_bengali_tokenizer(str(tmp_path / "missing"), lambda: texts, 400, tmp_path / "other")


def test_normalizer_homogenises_bengali_characters_and_spaces():
    normalize = bengali_normalizer().normalize_str
    assert normalize("আমি  বাংলায়\u09e4 গান গাই|") == "আমি বাংলায়\u0964 গান গাই\u0964"  # dandas unified
    assert normalize("\u09e5") == "\u0965"
    assert normalize("\u09f7") == "\u0964"
    assert normalize("দু:খ") == normalize("দুঃখ")  # colon after a Bengali letter is the visarga
    assert normalize("ratio: 1") == "ratio: 1"  # ...but not after Latin text
    assert normalize("\u09dc") == "\u09a1\u09bc"  # NFKC: precomposed RRA -> DDA + nukta
    assert normalize("Hello\tWORLD") == "hello world"


def test_pre_tokenizer_isolates_digits_and_punctuation():
    pieces = [piece for piece, _ in bengali_pre_tokenizer().pre_tokenize_str("আমি ১২৩ টি বই কিনেছি।")]
    assert pieces == ["▁আমি", "▁", "১", "২", "৩", "▁টি", "▁বই", "▁কিনেছি", "।"]


def test_trained_tokenizer_pairs_and_round_trip(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(tmp_path))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))  # transformers-loadable, no manual JSON edits
    encoded = reloaded("ফাইল আপলোড", "আপলোড করুন")
    tokens = reloaded.convert_ids_to_tokens(encoded["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    assert encoded["token_type_ids"][-1] == 1 and encoded["token_type_ids"][0] == 0
    assert reloaded.decode(reloaded("ফাইল আপলোড", add_special_tokens=False)["input_ids"]) == "ফাইল আপলোড"


def test_sentences_split_on_danda_question_exclamation_and_lines():
    text = "আমি ভাত খাই। তুমি কী খাও? চমৎকার! শেষ॥ নতুন\nলাইন"
    assert split_sentences(text) == ["আমি ভাত খাই।", "তুমি কী খাও?", "চমৎকার!", "শেষ॥", "নতুন", "লাইন"]


def test_mixer_observed_ratio_matches_probabilities():
    documents = 4000
    sources = Counter(example[SOURCE_COLUMN] for example in islice(mixed_stream(FIXTURE_STREAM, seed=3), documents))
    share = sources[0] / documents
    assert abs(share - 0.23) < 0.03, sources  # binomial std is 0.0067 at this size


def test_mixer_is_seeded_per_peer():
    small_buffer = replace(FIXTURE_STREAM, shuffle_buffer=200)
    first = [example["text"] for example in islice(mixed_stream(small_buffer, seed=1), 20)]
    again = [example["text"] for example in islice(mixed_stream(small_buffer, seed=1), 20)]
    other = [example["text"] for example in islice(mixed_stream(small_buffer, seed=2), 20)]
    assert first == again and first != other


def test_streaming_sop_batches(tokenizer):
    dataset = StreamingSopDataset(
        FIXTURE_STREAM, tokenizer, max_seq_length=32, short_seq_probability=0.1, mlm_probability=0.15
    )
    batches = list(islice(dataset.stream(stream_seed=5, batch_size=8), 6))
    batch = batches[0]
    assert batch["input_ids"].shape == (8, 32) and batch["sample_ids"].dtype == torch.long
    assert (batch["input_ids"][:, 0] == tokenizer.cls_token_id).all()
    masked = batch["labels"] != -100
    assert 0 < masked.sum() < batch["attention_mask"].sum()
    assert set(torch.cat([b["sentence_order_label"] for b in batches]).tolist()) == {0, 1}
    assert set(torch.cat([b[SOURCE_COLUMN] for b in batches]).tolist()) == {0, 1}
    assert len({int(i) for b in batches for i in b["sample_ids"]}) == 48  # unique sample ids


def test_missing_local_source_and_bad_probabilities_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no .txt/.json"):
        list(islice(mixed_stream(replace(FIXTURE_STREAM, sources=[str(tmp_path), FIXTURE_STREAM.sources[1]]), 0), 1))
    with pytest.raises(ConfigError, match="task.stream.probabilities must sum to 1"):
        load_config(Path("configs/sahajbert/tiny.yaml"), ["task.stream.probabilities=[0.5,0.6]"])


def test_configs_load():
    paper = load_config(Path("configs/sahajbert/paper.yaml"))
    assert paper.task.vocab_size == 32000 and paper.task.hidden_size == 1024 and paper.network.client_mode
    assert paper.task.stream.probabilities == [0.23, 0.77] and paper.task.stream.shuffle_buffer == 10_000
    tiny = load_config(Path("configs/sahajbert/tiny.yaml"))
    assert tiny.task.corpus == "bengali_stream"
