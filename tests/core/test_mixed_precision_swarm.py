"""fp16 with dynamic loss scaling across processes, on CPU (debug.fp16_on_cpu: the same autocast and scaler code a
GPU run takes): a 2-peer sync swarm with hivemind.GradScaler, and a 2-worker DDP run killed and resumed from its
checkpoint."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time

import psutil
import pytest
import torch

from common.tools.comparison import torchrun_command
from tests.helpers import (
    EQUIVALENCE_OVERRIDES,
    ROOT,
    TINY_ALBERT,
    assert_no_processes_left,
    degraded_rounds,
    differences_from_replay,
    max_difference,
    read_jsonl,
    run_trainers,
)

FP16_ON_CPU = ["training.precision=fp16", "debug.fp16_on_cpu=true"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_sync_swarm_with_an_overflow_equals_single_process_and_every_peer_skips_it(tmp_path, tiny_overrides):
    # Two steps: with task.warmup_steps=1 the first has learning rate 0 (LAMB only fills its moments), so the second
    # runs its fp16 forward and backward from the initial weights in the swarm and in the replay alike and the
    # final weights differ only by float32 sums in another order (~1e-7). A third step would start from weights
    # ~1e-7 apart; cast to float16 some of them round the other way, and LAMB, which normalises every gradient
    # element, turns such fp16-level differences into weight differences up to lr (measured in one process, fp16,
    # the same micro-batches in reverse order: 1.2e-7 after one update, 2.5e-5 after two).
    steps, target = 2, 256
    overrides = [
        *tiny_overrides,
        *FP16_ON_CPU,
        "debug.inject_overflow_at_step=1",  # both peers: their first micro-batch of step 1 overflows
        f"training.max_global_steps={steps}",
        f"collaboration.target_batch_size={target}",
        *EQUIVALENCE_OVERRIDES,
    ]
    trainers = ["trainer0", "trainer1"]
    run_trainers(TINY_ALBERT, tmp_path, overrides, trainers, timeout=400)
    assert_no_processes_left(tmp_path)
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in trainers]
    # every peer discarded its overflowing micro-batch of step 1 and halved its scale: the scales stay equal
    assert [(summary["overflow_discards"], summary["loss_scale"]) for summary in summaries] == [(1, 2.0**15)] * 2
    for name in trainers:
        assert "fp16 overflow at global step 1" in (tmp_path / name / "peer.log").read_text()

    # the step logs hold only the micro-batches that reached a step, each with the loss scale its backward ran at:
    # one process on exactly those, in the same fp16 autocast at those scales, gives the same parameters
    differences = differences_from_replay(TINY_ALBERT, tmp_path, overrides, trainers, steps)
    finals = [torch.load(tmp_path / name / "final_model.pt") for name in trainers]
    assert max_difference(finals[0], finals[1]) == 0.0  # both applied the same averaged gradients, byte for byte
    assert max(differences) < 1e-5, (differences, degraded_rounds([tmp_path / name for name in trainers]))


def torchrun(output_dir, overrides, log_path, **popen_options) -> subprocess.Popen:
    """A 2-worker DDP run as a user starts it; its output goes to ``log_path`` (a pipe nobody reads while the run
    goes on could fill up and stall it)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [*torchrun_command(2, TINY_ALBERT), *overrides, f"training.output_dir={output_dir}"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            **popen_options,
        )


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once, as a lost machine would. (torchrun starts each worker in a
    session of its own, so killing torchrun's process group leaves the workers training.)"""
    victims = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    process.wait()
    psutil.wait_procs(victims, timeout=30)


# torch warns this way when something replaces optimizer.step after the LR scheduler wrapped it (accelerate's fp16
# step does, unless the scheduler is built first: common/ddp.py)
SCHEDULER_ORDER_WARNINGS = ("has been overridden after learning rate scheduler", "lr_scheduler.step()` before")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_killed_mid_run_resumes_from_its_newest_checkpoint(tmp_path, tiny_ddp_overrides):
    steps = 10
    overrides = [
        *tiny_ddp_overrides,
        *FP16_ON_CPU,
        f"training.max_global_steps={steps}",
        "training.checkpoint_every_steps=3",
        "training.keep_checkpoints=2",
        "task.classifier_dropout_prob=0.0",
    ]
    checkpoints = tmp_path / "checkpoints"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = torchrun(tmp_path, overrides, first_log, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "step_0000003.pt.sha256").exists():
            assert first.poll() is None, f"the run ended before its first checkpoint: {first_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
    finally:
        kill_tree(first)
    killed_at = max(record["step"] for record in read_jsonl(tmp_path / "history.jsonl")) + 1
    assert killed_at < steps, "the first run was not killed mid-run"

    second = torchrun(tmp_path, overrides, second_log, start_new_session=True)
    try:
        second.wait(timeout=400)
    finally:
        if second.poll() is None:
            kill_tree(second)
    output = second_log.read_text()
    assert second.returncode == 0, output[-3000:]
    for warning in SCHEDULER_ORDER_WARNINGS:
        assert warning not in first_log.read_text() + output, warning
    resumed = [int(line.rsplit("global step", 1)[1]) for line in output.splitlines() if "resumed from" in line]
    assert resumed and resumed[0] >= 3 and resumed[0] % 3 == 0 and resumed[0] <= killed_at, (resumed, killed_at)
    history = [record["step"] for record in read_jsonl(tmp_path / "history.jsonl")]
    assert history[-(steps - resumed[0]) :] == list(range(resumed[0], steps))  # the step count continued
    for rank in (0, 1):
        summary = json.loads((tmp_path / f"worker{rank}" / "summary.json").read_text())
        assert summary["global_steps"] == steps
    final = [torch.load(tmp_path / f"worker{rank}" / "final_model.pt") for rank in (0, 1)]
    assert max_difference(final[0], final[1]) == 0.0  # DDP workers hold one state
    assert all(bool(torch.isfinite(value).all()) for value in final[0].values() if value.is_floating_point())
    assert len(list(checkpoints.glob("step_*.pt"))) == 2  # keep_checkpoints
