"""The HPC baseline backend: torch DDP through accelerate (gloo on CPU, nccl on GPU).

Launch one process per worker with ``torchrun --nproc_per_node=N scripts/train.py ... training.backend=ddp``
(or ``accelerate launch``). Each worker accumulates ``k`` equal micro-batches; DDP all-reduces (averages) the
accumulated gradients on the k-th, so one optimizer step sees the mean gradient of
``target_batch_size = local_batch_size x k x workers`` samples -- the collaborative run's global batch.

Mixed precision is accelerate's: ``accelerator.backward`` scales an fp16 loss and the prepared optimizer
unscales, checks the (all-reduced, hence identical) gradients and skips the step on every worker alike. Rank 0
saves a checkpoint every ``training.checkpoint_every_steps`` global steps; every worker resumes from the newest
good one in ``<output_dir>/checkpoints`` (the workers must share that folder: one machine, or a shared disk).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator

from common.backends import TrainingBackend, load_baseline_state
from common.config import CollaborationConfig, TrainingConfig
from common.context import RunContext
from common.errors import ConfigError
from common.metrics import HistoryWriter, StepRecord, aggregate_step
from common.precision import Precision
from common.task import Task

logger = logging.getLogger(__name__)


class DDPBackend(TrainingBackend):
    def __init__(self, task: Task, training: TrainingConfig, collab: CollaborationConfig, context: RunContext):
        """``training.local_batch_size`` and ``collab.target_batch_size`` set the accumulation; ``context``: the
        device and precision (accelerate's scaler for fp16)."""
        precision = context.precision
        self.accelerator = Accelerator(
            cpu=context.device.type != "cuda",
            mixed_precision={Precision.fp32: "no", Precision.fp16: "fp16", Precision.bf16: "bf16"}[precision],
        )
        if precision.loss_scaling and self.accelerator.scaler is None:
            # accelerate creates no GradScaler on a CPU (it treats fp16 there as "no"); debug.fp16_on_cpu runs the
            # same accelerate code path with torch's CPU scaler, set before the optimizer is prepared
            self.accelerator.scaler = torch.amp.GradScaler("cpu")
        self.grad_scaler = self.accelerator.scaler
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes
        per_step = training.local_batch_size * self.world_size
        if collab.target_batch_size % per_step:
            raise ConfigError(
                f"collaboration.target_batch_size ({collab.target_batch_size}) must be a multiple of "
                f"training.local_batch_size x workers ({training.local_batch_size} x {self.world_size})"
            )
        self.accumulation_steps = collab.target_batch_size // per_step
        self.task = task
        self.model = self.accelerator.prepare_model(task.model)
        optimizer = task.make_optimizer(task.optimizer_param_groups())
        # the scheduler first: it wraps optimizer.step to check the call order, and accelerate's fp16 step swaps
        # optimizer.step for the method it saw when preparing; prepared the other way round, the scheduler's
        # wrapper is gone after the first step and torch warns that optimizer.step was overridden
        self.scheduler = task.make_scheduler(optimizer)
        self.optimizer = self.accelerator.prepare_optimizer(optimizer)
        self.micro_batches_done = 0
        self._global_step = 0
        self.history = HistoryWriter(Path(training.output_dir)) if self.rank == 0 else None
        logger.info(
            f"DDP worker {self.rank}/{self.world_size}: {self.accumulation_steps} micro-batches of "
            f"{training.local_batch_size} per step, global batch {collab.target_batch_size}"
        )

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def worker_label(self) -> Optional[str]:
        return f"worker{self.rank}"

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.model

    def micro_step_context(self):
        """Skip the all-reduce on all but the last micro-batch of a global step (gradients add up in .grad)."""
        if self.micro_batches_done + 1 < self.accumulation_steps:
            return self.accelerator.no_sync(self.model)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self, batch_size: int) -> Optional[int]:
        self.micro_batches_done += 1
        if self.micro_batches_done < self.accumulation_steps:
            return None
        with torch.no_grad():
            for param in self.task.model.parameters():
                if param.grad is not None:
                    param.grad.div_(self.accumulation_steps)  # DDP averaged over workers; now over micro-batches
        self.optimizer.step()  # accelerate's: unscale, skip on inf/NaN, update the scale (fp16)
        if self.optimizer.step_was_skipped:
            self.overflow_discards += 1
            logger.warning(f"fp16 overflow: global step {self._global_step} skipped on every worker")
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_batches_done = 0
        finished = self._global_step
        self._global_step += 1
        return finished

    def zero_grad(self) -> None:
        """Gradients accumulate in .grad between all-reduces; they are cleared after each optimizer step."""

    def checkpoint_state(self) -> Optional[dict]:
        if self.rank != 0:
            return None  # every worker holds the same state after a step
        return {
            "step": self._global_step,
            "model": self.task.model.state_dict(),
            "optimizer": self.optimizer.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "world_size": self.world_size,
        }

    def load_checkpoint_state(self, state: dict) -> None:
        load_baseline_state(self.task.model, self.optimizer.optimizer, self.scheduler, self.grad_scaler, state)
        self._global_step = int(state["step"])

    def publish(self, records: List[StepRecord]) -> None:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, records[-1].dict() if records else None)
        if self.history is not None and all(gathered):
            step_records = {f"worker{rank}": StepRecord.parse_obj(record) for rank, record in enumerate(gathered)}
            self.history.write(aggregate_step(step_records["worker0"].step, step_records))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
