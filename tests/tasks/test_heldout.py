"""The held-out split: documents no training run sees, scored after training (parity experiments)."""

import torch

from albert.corpus import OFFLINE_WIKIPEDIA, load_documents
from albert.task import build_task, split_heldout
from common.config import load_config
from tests.helpers import ROOT


def test_split_is_stable_disjoint_and_about_the_asked_share():
    documents = load_documents(OFFLINE_WIKIPEDIA, None, 2000)
    train, heldout = split_heldout(documents, 0.1)
    assert (train, heldout) == split_heldout(documents, 0.1)
    assert len(train) + len(heldout) == len(documents) and not set(train) & set(heldout)
    assert 150 <= len(heldout) <= 250  # a hash, not an exact count: 10 % of 2000 give or take
    assert split_heldout(documents, 0.0) == (documents, [])


def test_heldout_batches_come_from_documents_never_trained_on(tmp_path):
    torch.set_num_threads(1)
    overrides = [
        "task.max_documents=1000",
        "task.vocab_size=600",
        "task.max_seq_length=32",
        "task.heldout_fraction=0.1",
        f"task.cache_dir={tmp_path}",
        "training.local_batch_size=8",
    ]
    task = build_task(load_config(str(ROOT / "configs/albert/tiny.yaml"), overrides))
    batches = task.heldout_batches(2)
    assert len(batches) == 2 and all(batch["input_ids"].shape == (8, 32) for batch in batches)
    assert (batches[0]["labels"] != -100).any()  # masked like training data
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, task.heldout_batches(2)))
    # no held-out example is a training example: compare the uncorrupted token rows
    training_rows = {tuple(row.tolist()) for row in task.dataset.padded(torch.arange(len(task.dataset)))[0]}
    heldout = task.heldout_batches(2)
    originals = torch.where(heldout[0]["labels"] != -100, heldout[0]["labels"], heldout[0]["input_ids"])
    assert not any(tuple(row.tolist()) in training_rows for row in originals)
    without = build_task(
        load_config(str(ROOT / "configs/albert/tiny.yaml"), [*overrides[:3], f"task.cache_dir={tmp_path}"])
    )
    assert without.heldout_batches(2) is None
