"""ALBERT task: the paper-scale model and optimizer build on CPU; data building blocks behave."""

import pickle
import random

import hivemind
import numpy as np
import pytest
import torch
from hivemind.utils import get_dht_time

from albert import data as albert_data
from albert.corpus import load_documents, wikitext_documents
from albert.data import SopDataset, SpecialIds, build_examples, create_sop_instances, mask_tokens, special_ids
from albert.task import AlbertTask, build_task
from albert.tokenizer import SPECIAL_TOKENS, train_unigram_tokenizer
from common.backends import RunFingerprints, require_same_model
from common.config import load_config
from common.errors import ConfigError, DataError, PeerError
from common.metrics import PeerMetrics, metrics_key
from tests.helpers import ROOT


def test_paper_config_builds_albert_large_and_its_lamb_optimizer():
    config = load_config(ROOT / "configs/albert/paper.yaml")
    task = build_task(config, with_data=False)
    parameters = sum(param.numel() for param in task.model.parameters())
    assert 17_500_000 < parameters < 18_200_000  # albert-large-v2: ~17.7 M (shared layers)
    optimizer = task.make_optimizer(task.optimizer_param_groups())
    scheduler = task.make_scheduler(optimizer)
    assert type(optimizer).__name__ == "Lamb" and optimizer.defaults["lr"] == pytest.approx(0.00176)
    no_decay = [group for group in optimizer.param_groups if group["weight_decay"] == 0.0]
    assert no_decay and all(param.dim() == 1 for param in no_decay[0]["params"])  # biases and LayerNorms
    # one real optimizer step on a tiny batch (random token ids: a unit test of the step, not of learning)
    batch = {
        "input_ids": torch.randint(5, 30000, (1, 32)),
        "attention_mask": torch.ones(1, 32, dtype=torch.long),
        "token_type_ids": torch.zeros(1, 32, dtype=torch.long),
        "sentence_order_label": torch.tensor([1]),
        "labels": torch.full((1, 32), -100),
    }
    batch["labels"][0, 3] = 42
    before = task.model.albert.embeddings.word_embeddings.weight[42].clone()
    output = task.forward(task.model, batch)
    output.loss.backward()
    for _ in range(2):  # warmup: the first step runs at lr 0
        optimizer.step()
        scheduler.step()
    assert not torch.equal(before, task.model.albert.embeddings.word_embeddings.weight[42])


def test_sop_instances_are_pairs_with_balanced_labels():
    ids = SpecialIds(cls=2, sep=3, pad=0, mask=4, vocab_size=100)
    document = [[10 + index] * 5 for index in range(40)]
    instances = create_sop_instances(document, 32, 0.0, random.Random(0), ids)
    assert instances
    for instance in instances:
        tokens = instance["input_ids"]
        assert len(tokens) == 32 and tokens[0] == ids.cls and tokens.count(ids.sep) == 2
    labels = [instance["sentence_order_label"] for instance in instances]
    assert 0 in labels and 1 in labels


def test_masking_is_deterministic_and_spares_special_tokens():
    ids = SpecialIds(cls=2, sep=3, pad=0, mask=4, vocab_size=100)
    tokens = torch.tensor([[2] + list(range(10, 70)) + [3, 0, 0]])
    attention = (tokens != 0).long()
    first = mask_tokens(tokens, attention, ids, 0.15, torch.Generator().manual_seed(7))
    second = mask_tokens(tokens, attention, ids, 0.15, torch.Generator().manual_seed(7))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    chosen = first[1] != -100
    assert chosen.sum() > 0 and not chosen[0, 0] and not chosen[0, 61] and not chosen[0, -1]


def test_wikitext_lines_become_articles():
    lines = [
        " = Alpha = \n",
        " First line . \n",
        " = = Section = = \n",
        " More text . \n",
        " = Beta = \n",
        " Other . \n",
    ]
    assert wikitext_documents(lines) == ["First line . More text .", "Other ."]


def test_document_layout_is_chosen_by_config_not_by_the_corpus_name(tmp_path):
    corpus = tmp_path / "wikitext_copy.txt"
    corpus.write_text(" = Alpha = \n First paragraph . \n Second paragraph . \n = Beta = \n Other . \n")
    assert len(load_documents(str(corpus), None, None)) == 5  # every non-empty line, the heading lines too
    assert load_documents(str(corpus), None, None, "wikitext_article") == [
        "First paragraph . Second paragraph .",
        "Other .",
    ]
    with pytest.raises(ConfigError, match="task.document_layout must be one of line, wikitext_article"):
        load_config(ROOT / "configs/albert/tiny.yaml", ["task.document_layout=paragraphs"])
    assert load_config(ROOT / "configs/albert/paper.yaml").task.document_layout == "line"  # as the authors read it


@pytest.mark.slow  # two spawned processes
@pytest.mark.timeout(300)
def test_examples_are_unpadded_and_the_same_whatever_the_number_of_build_processes(monkeypatch, tmp_path):
    documents = load_documents("offline_wikipedia", None, 150)
    tokenizer = train_unigram_tokenizer(documents, 500)
    monkeypatch.setattr(albert_data, "DOCUMENTS_PER_SHARD", 50)  # three shards
    alone = build_examples(documents, tokenizer, 64, 0.1, seed=5, workers=1)
    # streamed from a reader of the corpus, stored in a folder and read back memory-mapped
    shared = build_examples(lambda: iter(documents), tokenizer, 64, 0.1, seed=5, workers=2, folder=tmp_path / "ex")
    assert isinstance(shared["tokens"], np.memmap) and sorted(path.name for path in (tmp_path / "ex").iterdir()) == [
        "examples.json",
        "first_segment.npy",
        "offsets.npy",
        "sentence_order_label.npy",
        "tokens.npy",
    ]
    assert alone.keys() == shared.keys() and all(np.array_equal(alone[name], shared[name]) for name in alone)
    count = len(alone["sentence_order_label"])
    assert count > 50 and alone["tokens"].dtype == np.int32 and len(alone["tokens"]) == int(alone["offsets"][-1])
    # the padded batch is what the padded recipe (create_sop_instances) gives for the same pairs
    ids = special_ids(tokenizer)
    dataset = SopDataset(alone, ids, 0.15, seed=0, max_seq_length=64)
    input_ids, attention_mask, token_type_ids = dataset.padded(torch.arange(count))
    first = int(alone["offsets"][1])
    tokens = alone["tokens"][:first].tolist()
    mapped = SopDataset(shared, ids, 0.15, 0, 64, folder=tmp_path / "ex")
    assert dataset.batch([3, 4], 1)["input_ids"].equal(mapped.batch([3, 4], 1)["input_ids"])
    # a copy for a loader worker process maps the files again instead of carrying the arrays
    shipped = pickle.dumps(mapped)
    assert len(shipped) < 2000 and pickle.loads(shipped).batch([3, 4], 1)["labels"].equal(
        mapped.batch([3, 4], 1)["labels"]
    )
    split = int(alone["first_segment"][0])
    reference = albert_data._pack(tokens[1 : split - 1], tokens[split:-1], 0, 64, ids)
    assert (
        input_ids[0].tolist() == reference["input_ids"] and attention_mask[0].tolist() == reference["attention_mask"]
    )
    assert token_type_ids[0].tolist() == reference["token_type_ids"]
    assert int(attention_mask.sum()) == len(alone["tokens"]) and input_ids.shape == (count, 64)
    batch = dataset.batch([0, 1, 2], pass_index=0)
    assert all(batch[name].dtype == torch.long for name in ("input_ids", "labels", "attention_mask", "token_type_ids"))


def test_unreachable_hub_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="hub is unreachable"):
        load_documents("wikitext", "wikitext-103-raw-v1", None)


def test_tokenizers_trained_apart_give_every_piece_the_same_id():
    # a volunteer trains the run's tokenizer on its own machine; the Rust trainer's hash maps are seeded anew each
    # time, which reorders pieces of (nearly) equal score
    documents = load_documents("offline_wikipedia", None, 300)
    first, second = (train_unigram_tokenizer(documents, 1000) for _ in range(2))
    ids = list(range(len(first)))
    assert len(first) == len(second) == 1000
    assert first.convert_ids_to_tokens(ids) == second.convert_ids_to_tokens(ids)
    assert first.convert_ids_to_tokens(ids)[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert first(documents[:50])["input_ids"] == second(documents[:50])["input_ids"]


def test_a_trainer_with_another_tokenizer_is_refused_in_one_line():
    config = load_config(str(ROOT / "configs/albert/tiny.yaml")).task
    documents = load_documents("offline_wikipedia", None, 300)
    run_tokenizer, other_tokenizer = (train_unigram_tokenizer(part, 1000) for part in (documents, documents[100:]))
    run_task, other_task = (
        AlbertTask(config, 16, None, 1000, tokenizer) for tokenizer in (run_tokenizer, other_tokenizer)
    )
    run, other = RunFingerprints.of(run_task), RunFingerprints.of(other_task)
    assert run.model == other.model and run.inputs != other.inputs
    assert RunFingerprints.of(AlbertTask(config, 16, None, 1000)).inputs == ""  # a peer without data
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        record = PeerMetrics(
            peer_name="trainer0", role="trainer", recent=[], model_fingerprint=run.model, input_fingerprint=run.inputs
        )
        dht.store(metrics_key("run"), record.dict(), get_dht_time() + 60, subkey=b"trainer0")
        require_same_model(dht, "run", run, run_task.input_mismatch_advice)
        with pytest.raises(PeerError, match=r"encodes its inputs differently .* task\.tokenizer=FOLDER"):
            require_same_model(dht, "run", other, other_task.input_mismatch_advice)
        with pytest.raises(PeerError, match="trains a different model"):
            require_same_model(dht, "run", RunFingerprints("another layout", run.inputs))
    finally:
        dht.shutdown()


def test_a_damaged_examples_cache_is_rebuilt_with_one_warning(tmp_path, caplog):
    documents = load_documents("offline_wikipedia", None, 40)
    tokenizer = train_unigram_tokenizer(documents, 300)
    folder = tmp_path / "cache" / "examples-0123"  # the cache folder does not exist yet

    def build(target):
        return build_examples(documents, tokenizer, 64, 0.0, seed=1, workers=1, folder=target)

    # copied out of the mapping: truncating a mapped file in place would end this process (SIGBUS); a rebuild
    # unlinks the damaged files instead, so a process still mapping them keeps reading the old data
    built = {name: np.array(array) for name, array in albert_data.load_or_build_example_arrays(folder, build).items()}
    (folder / "tokens.npy").write_bytes(b"not an array")  # a torn copy
    with caplog.at_level("WARNING", logger="albert.data"):
        rebuilt = albert_data.load_or_build_example_arrays(folder, build)
    assert [record.message for record in caplog.records if "unreadable" in record.message] == [
        f"the cached examples {folder} are unreadable (ValueError): rebuilding them"
    ]
    assert all(np.array_equal(built[name], rebuilt[name]) for name in built)
    assert sorted(path.name for path in folder.parent.iterdir()) == [folder.name]  # no temporary folder left
