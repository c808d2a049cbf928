"""THE training loop, shared by every experiment and every backend.

micro-batch -> forward -> (non-finite guard) -> backward -> task hook -> backend.step -> per-step record.
The backend decides when a global step happens; the loop only counts what this process contributed.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from common import startup
from common.backends import TrainingBackend
from common.checkpoints import save_checkpoint
from common.config import DebugConfig, TrainingConfig
from common.context import RunContext
from common.lifecycle import StopFlag
from common.metrics import StepRecord
from common.task import SAMPLE_IDS, Task

logger = logging.getLogger(__name__)
# An accelerator peer whose loop spends more than this share of its time waiting for the next micro-batch is
# input-bound: the trainer says so at each progress line.
DATA_WAIT_WARNING_SHARE = 0.2


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

    def record(self, totals: "ComputeTotals") -> StepRecord:
        now = time.time()
        samples = max(self.samples, 1)
        return StepRecord(
            step=self.step,
            samples=self.samples,
            loss=float(self.loss_sum / samples),
            seconds=float(max(0.0, now - self.started)),
            time=float(now),
            metrics={name: float(total / samples) for name, total in self.metric_sums.items()},
            computed_total=totals.computed,
            used_total=totals.used + self.samples,
            gradient_seconds_total=float(totals.gradient_seconds),
            wall_seconds_total=float(max(0.0, now - totals.started)),
        )


@dataclass
class ComputeTotals:
    """This process's running totals since the loop started: what its step records carry for the monitor's
    compute utilisation (``used``: samples in the global steps recorded so far)."""

    started: float
    computed: int = 0
    used: int = 0
    gradient_seconds: float = 0.0


@dataclass
class TrainingSummary:
    peer_name: str
    global_steps: int
    samples: int
    wall_seconds: float
    compute_seconds: float
    skipped_nonfinite: int
    stopped_by: str
    overflow_discards: int = 0  # fp16: times the loss scaler skipped this process's gradients (common/precision.py)
    loss_scale: Optional[float] = None  # fp16: the final loss scale
    peak_memory_mb: float = 0.0  # CUDA: peak allocated on the device; CPU: the process's peak resident set
    # of ``samples`` (computed), those in global steps this peer took part in: the rest were dropped when the swarm's
    # state replaced this peer's accumulated gradients (a missed round, a reload) or an fp16 overflow discarded them
    samples_used: int = 0
    gradient_seconds: float = 0.0  # of the wall time, forward and backward passes only (no averaging, no waiting)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def used_share(self) -> float:
        """Compute utilisation: the share of this peer's computed samples that entered a global step."""
        return self.samples_used / self.samples if self.samples else 0.0

    @property
    def compute_share(self) -> float:
        """The share of this peer's wall time spent computing gradients (the rest: start-up, input, averaging)."""
        return self.gradient_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            **self.__dict__,
            "samples_per_second": self.samples_per_second,
            "used_share": self.used_share,
            "compute_share": self.compute_share,
        }


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def _all_finite(parameters) -> bool:
    return all(param.grad is None or bool(torch.isfinite(param.grad).all()) for param in parameters)


class Trainer:
    def __init__(
        self,
        task: Task,
        backend: TrainingBackend,
        training: TrainingConfig,
        context: RunContext,
        *,
        peer_name: str,
        stream_seed: int,
        output_dir: Path,
        checkpoint_dir: Optional[Path] = None,
        debug: Optional[DebugConfig] = None,
        stop: Optional[StopFlag] = None,
        data_wait_warning_share: Optional[float] = None,
    ):
        """``training``: the loop's limits, logging, non-finite policy, loader workers and baseline checkpoints
        (``training.checkpoint_every_steps``: ``backend.checkpoint_state()`` saved to ``checkpoint_dir``);
        ``context``: this process's device and precision (the backend holds fp16's loss scaler). ``output_dir``
        and ``peer_name`` are this process's (a DDP worker's own), not necessarily ``training.output_dir``.
        ``debug``: fault injection and sample-id logging (tests). ``data_wait_warning_share``: warn when the loop
        waits for batches longer than this share of its time; None: ``DATA_WAIT_WARNING_SHARE`` on an accelerator,
        never on a CPU (there batches and the model share the cores, so more loader workers would only move the
        work)."""
        debug = debug if debug is not None else DebugConfig()
        self.task, self.backend, self.training, self.context = task, backend, training, context
        self.peer_name, self.stream_seed, self.output_dir = peer_name, stream_seed, output_dir
        self.checkpoint_dir, self.stop = checkpoint_dir, stop or StopFlag()
        self.device = context.device
        self.max_global_steps = training.max_global_steps
        self.record_sample_ids, self.inject_nonfinite_every = debug.record_sample_ids, debug.inject_nonfinite_every
        self.inject_overflow_at_step = debug.inject_overflow_at_step  # set to -1 once injected
        if data_wait_warning_share is None and self.device.type != "cpu":
            data_wait_warning_share = DATA_WAIT_WARNING_SHARE
        self.data_wait_warning_share = data_wait_warning_share
        self.data_wait_seconds = 0.0  # since the last progress line
        self.records: List[StepRecord] = []
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.steps_log = self.output_dir / "steps.jsonl"

    def _finish_step(self, accumulator: StepAccumulator, finished_step: int, totals: ComputeTotals) -> None:
        accumulator.step = finished_step
        record = accumulator.record(totals)
        totals.used += record.samples
        self.records.append(record)
        self.backend.publish(self.records)
        entry = {"peer": self.peer_name, **record.dict()}
        if self.record_sample_ids:
            entry["micro_batches"] = accumulator.micro_batches
        with self.steps_log.open("a") as log:
            log.write(json.dumps(entry) + "\n")
        self.task.on_global_step(self.task.model, finished_step + 1)
        every = self.training.checkpoint_every_steps
        if every and (finished_step + 1) % every == 0:
            state = self.backend.checkpoint_state()
            if state is not None and self.checkpoint_dir is not None:
                save_checkpoint(self.checkpoint_dir, finished_step + 1, state, self.training.keep_checkpoints)

    def _inject_overflow(self) -> None:
        """Fault injection (tests): an infinite gradient, as an fp16 backward that overflowed leaves."""
        self.inject_overflow_at_step = -1  # once
        param = next(param for param in self.task.model.parameters() if param.grad is not None)
        param.grad.view(-1)[0] = float("inf")
        logger.warning(f"debug: injected an overflowing gradient at global step {self.backend.global_step}")

    def run(self) -> TrainingSummary:
        self.task.model.to(self.device)
        model = self.backend.prepare_model(self.task.model)
        model.train()
        started = time.time()
        compute_seconds, skipped = 0.0, 0
        totals = ComputeTotals(started=started)
        last_log = started
        stopped_by = "max_global_steps"
        accumulator = StepAccumulator(step=self.backend.global_step)
        batches = self.task.batch_stream(
            self.stream_seed, self.training.dataloader_workers, self.device.type == "cuda"
        )
        micro_batches_seen = 0
        while True:
            if self.backend.global_step >= self.max_global_steps:
                break
            if self.stop.is_set():
                stopped_by = f"signal {self.stop.signal_name}" if self.stop.signal_name else "stop requested"
                break
            max_wall_seconds = self.training.max_wall_seconds
            if max_wall_seconds is not None and time.time() - started > max_wall_seconds:
                stopped_by = "max_wall_seconds"
                break
            if accumulator.step != self.backend.global_step:  # state was reloaded from peers: start afresh
                accumulator = StepAccumulator(step=self.backend.global_step)

            waited = time.perf_counter()
            batch = next(batches)
            tick = time.perf_counter()
            self.data_wait_seconds += tick - waited
            sample_ids = batch.get(SAMPLE_IDS)
            batch = {name: value.to(self.device, non_blocking=True) for name, value in batch.items()}
            micro_batches_seen += 1
            with self.backend.micro_step_context():
                with self.context.precision.autocast(self.device):
                    output = self.task.forward(model, batch)
                if self.inject_nonfinite_every and micro_batches_seen % self.inject_nonfinite_every == 0:
                    output.loss = output.loss * float("nan")  # fault injection (tests only)
                loss_value = float(output.loss.detach())
                finite = math.isfinite(loss_value) or not self.training.skip_nonfinite
                if finite:
                    self.backend.backward(output.loss)
                    if self.inject_overflow_at_step == self.backend.global_step:
                        self._inject_overflow()
            if not finite:
                skipped += 1
                logger.warning(
                    f"non-finite loss ({loss_value}) at step {self.backend.global_step}: micro-batch skipped"
                )
                self.backend.zero_grad()
                continue
            self.task.after_backward(self.task.model, self.backend.global_step)
            totals.gradient_seconds += time.perf_counter() - tick
            scaler_judges = self.backend.grad_scaler is not None  # it skips (and lowers the scale) by itself
            if self.training.skip_nonfinite and not scaler_judges and not _all_finite(self.task.model.parameters()):
                skipped += 1
                logger.warning(f"non-finite gradients at step {self.backend.global_step}: micro-batch skipped")
                self.backend.zero_grad()
                continue
            batch_ids = None
            if self.record_sample_ids and sample_ids is not None:
                batch_ids = {"ids": sample_ids.tolist(), "pass": int(batch.get("pass_index", torch.tensor(0)))}
                if self.backend.loss_scale is not None:  # fp16: the scale this micro-batch's backward ran with
                    batch_ids["loss_scale"] = self.backend.loss_scale
            accumulator.add(loss_value, output.batch_size, output.metrics, batch_ids)
            discards_before = (self.backend.state_reloads, self.backend.overflow_discards)
            finished = self.backend.step(output.batch_size)
            self.backend.zero_grad()
            if finished is None and (self.backend.state_reloads, self.backend.overflow_discards) != discards_before:
                # the swarm's state replaced our accumulated work, or an fp16 overflow discarded it
                accumulator = StepAccumulator(step=self.backend.global_step)
            compute_seconds += time.perf_counter() - tick
            totals.computed += output.batch_size
            startup.first_contribution()
            if finished is not None:
                self._finish_step(accumulator, finished, totals)
                accumulator = StepAccumulator(step=self.backend.global_step)
                if not all(bool(torch.isfinite(param).all()) for param in self.task.model.parameters()):
                    logger.error(f"parameters are not finite after global step {finished}: recovering")
                    self.backend.recover_from_nonfinite_parameters()

            now = time.time()
            if now - last_log >= self.training.log_every_seconds:
                self._warn_if_waiting_on_data(now - last_log)
                last_log = now
                self._log_progress(started, totals.computed)

        summary = TrainingSummary(
            peer_name=self.peer_name,
            global_steps=self.backend.global_step,
            samples=totals.computed,
            wall_seconds=time.time() - started,
            compute_seconds=compute_seconds,
            skipped_nonfinite=skipped,
            stopped_by=stopped_by,
            overflow_discards=self.backend.overflow_discards,
            loss_scale=self.backend.loss_scale,
            peak_memory_mb=peak_memory_mb(self.device),
            samples_used=totals.used,
            gradient_seconds=totals.gradient_seconds,
        )
        logger.info(
            f"stopped ({stopped_by}) at global step {summary.global_steps}: {summary.samples} samples, "
            f"{summary.samples_per_second:.1f} samples/s, {summary.used_share:.0%} of them in global steps, "
            f"{summary.compute_share:.0%} of the time computing"
        )
        return summary

    def _warn_if_waiting_on_data(self, window_seconds: float) -> None:
        share = self.data_wait_seconds / max(window_seconds, 1e-9)
        self.data_wait_seconds = 0.0
        if self.data_wait_warning_share is not None and share > self.data_wait_warning_share:
            logger.warning(
                f"the loop waited for input batches {share:.0%} of the last {window_seconds:.0f} s: raise "
                f"training.dataloader_workers (now {self.training.dataloader_workers}) if this machine has idle cores"
            )

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
        # what the volunteer gives, and what the swarm does with it (as hivemind's own example reports)
        steps_contributed = sum(1 for record in self.records if record.samples > 0)
        swarm = self.backend.swarm_status()
        swarm_text = (
            "" if swarm is None else f" | swarm: {swarm.peers} peers, {swarm.samples_per_second:.1f} samples/s"
        )
        logger.info(f"your contribution: {samples_total} samples, {steps_contributed} steps{swarm_text}")
