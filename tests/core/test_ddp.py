"""The HPC baseline: torch DDP (gloo, 2 CPU workers via torchrun) equals one process with the same global batch."""

import re

import pytest
import torch
from transformers import AlbertForPreTraining

from common.config import load_config
from tests.helpers import (
    REPLAYABLE_OVERRIDES,
    ROOT,
    TINY_ALBERT,
    max_difference,
    read_step_logs,
    replay_single_process,
    run_ddp_training,
)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_two_workers_equal_single_process_on_the_same_samples(tmp_path, tiny_ddp_overrides):
    steps = 3
    overrides = [*tiny_ddp_overrides, *REPLAYABLE_OVERRIDES, f"training.max_global_steps={steps}"]
    result = run_ddp_training(*overrides, f"training.output_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    history = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(history) == steps  # one aggregated line per global step, written by worker 0

    records = read_step_logs([tmp_path / f"worker{rank}" / "steps.jsonl" for rank in (0, 1)])
    assert all(sum(len(batch["ids"]) for batch in record["micro_batches"]) == 32 for record in records)
    single = load_config(TINY_ALBERT, [*overrides, "training.backend=single"])
    reference = replay_single_process(single, records, steps)
    for rank in (0, 1):
        worst = max_difference(torch.load(tmp_path / f"worker{rank}" / "final_model.pt"), reference)
        assert worst < 1e-5, f"DDP worker {rank} differs from the single-process run by {worst}"
    # each worker also leaves its final weights as a Hugging Face folder
    exported = AlbertForPreTraining.from_pretrained(tmp_path / "worker0" / "hf_model").state_dict()
    assert max_difference(exported, torch.load(tmp_path / "worker0" / "final_model.pt")) == 0


@pytest.mark.slow
def test_ddp_rejects_a_global_batch_that_workers_cannot_split(tmp_path):
    result = run_ddp_training(
        "training.backend=ddp",
        "collaboration.target_batch_size=50",
        "training.local_batch_size=16",
        "task.max_documents=3000",
        f"training.output_dir={tmp_path}",
        timeout=300,
    )
    assert result.returncode != 0
    # every worker stops with one line naming the problem; torchrun then reports the failed workers with a traceback
    # of its own, but no frame of that or any other traceback is in our code
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 2, result.stderr[-3000:]
    assert all("must be a multiple of" in line for line in error_lines)
    assert not re.search(rf'File "{ROOT}/(common|albert|swav|scripts)/', result.stderr), result.stderr[-3000:]
