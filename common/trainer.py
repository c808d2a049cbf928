"""THE training loop, shared by every experiment and every backend.

micro-batch -> forward -> (non-finite guard) -> backward -> task hook -> backend.step -> per-step record.
The backend decides when a global step happens; the loop only counts what this process contributed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from common.backends import TrainingBackend
from common.lifecycle import StopFlag
from common.metrics import StepRecord
from common.task import SAMPLE_IDS, Task

logger = logging.getLogger(__name__)


@dataclass
class StepAccumulator:
    """What this process contributed to the global step in progress."""

    step: int
    started: float = field(default_factory=time.time)
    samples: int = 0
    loss_sum: float = 0.0
    metric_sums: Dict[str, float] = field(default_factory=dict)
    micro_batches: List[dict] = field(default_factory=list)

    def add(self, loss: float, batch_size: int, metrics: Dict[str, float], batch_ids: Optional[dict]) -> None:
        self.samples += batch_size
        self.loss_sum += loss * batch_size
        for name, value in metrics.items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value * batch_size
        if batch_ids is not None:
            self.micro_batches.append(batch_ids)

    def record(self) -> StepRecord:
        now = time.time()
        samples = max(self.samples, 1)
        return StepRecord(
            step=self.step,
            samples=self.samples,
            loss=float(self.loss_sum / samples),
            seconds=float(max(0.0, now - self.started)),
            time=float(now),
            metrics={name: float(total / samples) for name, total in self.metric_sums.items()},
        )


@dataclass
class TrainingSummary:
    peer_name: str
    global_steps: int
    samples: int
    wall_seconds: float
    compute_seconds: float
    skipped_nonfinite: int
    stopped_by: str

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {**self.__dict__, "samples_per_second": self.samples_per_second}


def _all_finite(parameters) -> bool:
    return all(param.grad is None or bool(torch.isfinite(param.grad).all()) for param in parameters)


class Trainer:
    def __init__(
        self,
        task: Task,
        backend: TrainingBackend,
        *,
        peer_name: str,
        stream_seed: int,
        max_global_steps: int,
        max_wall_seconds: Optional[float],
        output_dir: Path,
        device: torch.device,
        precision: str = "fp32",
        log_every_seconds: float = 10.0,
        record_sample_ids: bool = False,
        skip_nonfinite: bool = True,
        inject_nonfinite_every: int = 0,
        stop: Optional[StopFlag] = None,
    ):
        self.task, self.backend, self.peer_name = task, backend, peer_name
        self.stream_seed, self.max_global_steps, self.max_wall_seconds = (
            stream_seed,
            max_global_steps,
            max_wall_seconds,
        )
        self.output_dir, self.device, self.precision = output_dir, device, precision
        self.log_every_seconds, self.record_sample_ids = log_every_seconds, record_sample_ids
        self.skip_nonfinite, self.stop = skip_nonfinite, stop or StopFlag()
        self.inject_nonfinite_every = inject_nonfinite_every
        self.records: List[StepRecord] = []
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.steps_log = self.output_dir / "steps.jsonl"

    def _autocast(self):
        if self.device.type == "cuda" and self.precision in ("fp16", "bf16"):
            return torch.autocast("cuda", dtype=torch.float16 if self.precision == "fp16" else torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def _finish_step(self, accumulator: StepAccumulator, finished_step: int) -> None:
        accumulator.step = finished_step
        record = accumulator.record()
        self.records.append(record)
        self.backend.publish(self.records)
        entry = {"peer": self.peer_name, **record.dict()}
        if self.record_sample_ids:
            entry["micro_batches"] = accumulator.micro_batches
        with self.steps_log.open("a") as log:
            log.write(json.dumps(entry) + "\n")
        self.task.on_global_step(self.task.model, finished_step + 1)

    def run(self) -> TrainingSummary:
        self.task.model.to(self.device)
        model = self.backend.prepare_model(self.task.model)
        model.train()
        started = time.time()
        compute_seconds, samples_total, skipped = 0.0, 0, 0
        last_log = started
        stopped_by = "max_global_steps"
        accumulator = StepAccumulator(step=self.backend.global_step)
        batches = self.task.batches(self.stream_seed)
        micro_batches_seen = 0
        while True:
            if self.backend.global_step >= self.max_global_steps:
                break
            if self.stop.is_set():
                stopped_by = f"signal {self.stop.signal_name}" if self.stop.signal_name else "stop requested"
                break
            if self.max_wall_seconds is not None and time.time() - started > self.max_wall_seconds:
                stopped_by = "max_wall_seconds"
                break
            if accumulator.step != self.backend.global_step:  # state was reloaded from peers: start afresh
                accumulator = StepAccumulator(step=self.backend.global_step)

            batch = next(batches)
            tick = time.perf_counter()
            sample_ids = batch.get(SAMPLE_IDS)
            batch = {name: value.to(self.device) for name, value in batch.items()}
            micro_batches_seen += 1
            with self.backend.micro_step_context():
                with self._autocast():
                    output = self.task.forward(model, batch)
                if self.inject_nonfinite_every and micro_batches_seen % self.inject_nonfinite_every == 0:
                    output.loss = output.loss * float("nan")  # fault injection (tests only)
                loss_value = float(output.loss.detach())
                finite = math.isfinite(loss_value) or not self.skip_nonfinite
                if finite:
                    output.loss.backward()
            if not finite:
                skipped += 1
                logger.warning(
                    f"non-finite loss ({loss_value}) at step {self.backend.global_step}: micro-batch skipped"
                )
                self.backend.zero_grad()
                continue
            self.task.after_backward(self.task.model, self.backend.global_step)
            if self.skip_nonfinite and not _all_finite(self.task.model.parameters()):
                skipped += 1
                logger.warning(f"non-finite gradients at step {self.backend.global_step}: micro-batch skipped")
                self.backend.zero_grad()
                continue
            batch_ids = None
            if self.record_sample_ids and sample_ids is not None:
                batch_ids = {"ids": sample_ids.tolist(), "pass": int(batch.get("pass_index", torch.tensor(0)))}
            accumulator.add(loss_value, output.batch_size, output.metrics, batch_ids)
            reloads_before = self.backend.state_reloads
            finished = self.backend.step(output.batch_size)
            self.backend.zero_grad()
            if self.backend.state_reloads != reloads_before:  # the swarm's state replaced our accumulated work
                accumulator = StepAccumulator(step=self.backend.global_step)
            compute_seconds += time.perf_counter() - tick
            samples_total += output.batch_size
            if finished is not None:
                self._finish_step(accumulator, finished)
                accumulator = StepAccumulator(step=self.backend.global_step)
                if not all(bool(torch.isfinite(param).all()) for param in self.task.model.parameters()):
                    logger.error(f"parameters are not finite after global step {finished}: recovering")
                    self.backend.recover_from_nonfinite_parameters()

            now = time.time()
            if now - last_log >= self.log_every_seconds:
                last_log = now
                self._log_progress(started, samples_total)

        summary = TrainingSummary(
            peer_name=self.peer_name,
            global_steps=self.backend.global_step,
            samples=samples_total,
            wall_seconds=time.time() - started,
            compute_seconds=compute_seconds,
            skipped_nonfinite=skipped,
            stopped_by=stopped_by,
        )
        logger.info(
            f"stopped ({stopped_by}) at global step {summary.global_steps}: {summary.samples} samples, "
            f"{summary.samples_per_second:.1f} samples/s"
        )
        return summary

    def _log_progress(self, started: float, samples_total: int) -> None:
        step = self.backend.global_step
        elapsed = time.time() - started
        recent = self.records[-1] if self.records else None
        loss = f"{recent.loss:.4f}" if recent else "n/a"
        eta = ""
        if step > 0:
            seconds_left = (self.max_global_steps - step) * elapsed / step
            eta = f" | ETA {seconds_left / 60:.1f} min"
        logger.info(
            f"step {step}/{self.max_global_steps} | loss {loss} | "
            f"{samples_total / max(elapsed, 1e-9):.1f} samples/s{eta}"
        )
