"""Replays, in one process with plain PyTorch, exactly the micro-batches a distributed run logged per step."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import torch

from common.backends import SingleProcessBackend
from common.config import RunConfig


def read_step_logs(paths: List[Path]) -> List[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def replay_single_process(config: RunConfig, records: List[dict], steps: int) -> Dict[str, torch.Tensor]:
    """Train ``steps`` global steps; step s uses the union of every worker's micro-batches logged for s."""
    from albert.task import build_task

    torch.manual_seed(config.training.seed)
    task = build_task(config)
    backend = SingleProcessBackend(task, target_batch_size=config.collaboration.target_batch_size)
    for step in range(steps):
        micro_batches = [batch for record in records if record["step"] == step for batch in record["micro_batches"]]
        total = sum(len(batch["ids"]) for batch in micro_batches)
        # hivemind ends a step when its *estimate* of the swarm's samples reaches the target, so a step may hold a
        # little less (496 of 512 seen): the reference then steps on exactly those samples too
        assert total > 0, f"no micro-batch was logged for step {step}"
        backend.target_batch_size = total
        finished = None
        for micro_batch in micro_batches:
            output = task.forward(task.model, task.dataset.batch(micro_batch["ids"], micro_batch["pass"]))
            output.loss.backward()
            finished = backend.step(output.batch_size)
            backend.zero_grad()
        assert finished == step
    return task.model.state_dict()


def max_difference(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    return max(float((first[key] - second[key]).abs().max()) for key in first if first[key].is_floating_point())
