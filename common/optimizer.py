"""hivemind.Optimizer built from config: semantics preset, wire compression, declared bandwidth."""
from __future__ import annotations

import logging
import types
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import hivemind
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)

from common.config import CollaborationConfig, Compression, Semantics
from common.task import Task

logger = logging.getLogger(__name__)


def prefill_optimizer_state(optimizer: torch.optim.Optimizer, state_names: Sequence[str]) -> torch.optim.Optimizer:
    """Create the optimizer's per-parameter state as zeros, exactly as its first step would.

    hivemind runs a virtual optimizer step with zero gradients (at the base learning rate, before the
    scheduler exists) to create missing state; with weight decay that step shrinks the weights and it
    advances the step counter, so collaborative training would no longer equal plain training. A task's
    ``make_optimizer`` calls this so that no backend ever takes such a step.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            for name in state_names:
                state.setdefault(name, torch.zeros_like(param, memory_format=torch.preserve_format))
    return optimizer


def skip_nonfinite_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step`` a no-op (with a warning) when any gradient is NaN/Inf.

    A partial all-reduce can hand every peer of a round the same non-finite averaged gradient (hivemind divides a
    part by the total weight it received, which is 0 when only zero-weight peers got through). Skipping such a
    step, like an AMP grad scaler does, keeps every peer's parameters finite and still identical.
    """
    take_step = optimizer.step

    def guarded_step(self, *args, **kwargs):
        gradients = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not all(bool(torch.isfinite(gradient).all()) for gradient in gradients):
            logger.warning("the averaged gradient is not finite (a partial averaging round): optimizer step skipped")
            return None
        return take_step(*args, **kwargs)

    # a bound method, as torch's LR schedulers expect when they wrap optimizer.step
    optimizer.step = types.MethodType(guarded_step, optimizer)
    return optimizer


def make_compression(kind: Compression) -> CompressionBase:
    if kind == Compression.none:
        return NoCompression()
    if kind == Compression.fp16:
        return Float16Compression()
    if kind == Compression.scaled_fp16:
        return ScaledFloat16Compression()
    if kind == Compression.uniform8bit:
        return Uniform8BitQuantization()
    if kind == Compression.blockwise8bit:
        return BlockwiseQuantization()  # needs bitsandbytes at run time
    raise ValueError(f"unknown compression {kind}")


@dataclass(frozen=True)
class SemanticsFlags:
    use_local_updates: bool
    delay_optimizer_step: bool
    delay_grad_averaging: bool


SEMANTICS = {
    # The paper: every peer applies the same averaged gradient of the full target batch.
    Semantics.sync: SemanticsFlags(use_local_updates=False, delay_optimizer_step=False, delay_grad_averaging=False),
    # Delayed parameter updates: averaging and the optimizer step run in the background, one step stale.
    Semantics.dpu: SemanticsFlags(use_local_updates=False, delay_optimizer_step=True, delay_grad_averaging=True),
    # Local updates with parameter averaging every target batch.
    Semantics.local: SemanticsFlags(use_local_updates=True, delay_optimizer_step=False, delay_grad_averaging=False),
}


def make_collaborative_optimizer(
    dht: hivemind.DHT,
    task: Task,
    collab: CollaborationConfig,
    local_batch_size: Optional[int],
    auxiliary: bool = False,
) -> hivemind.Optimizer:
    """The task's optimizer wrapped in hivemind.Optimizer; ``auxiliary`` peers only help average."""
    flags = SEMANTICS[collab.semantics]
    compression = make_compression(collab.compression)
    averager_opts = {"bandwidth": collab.bandwidth} if collab.bandwidth is not None else {}
    # A late joiner's downloaded state fast-forwards its LR schedule to the swarm's step (hivemind steps the
    # scheduler without an optimizer step); that is intended, but torch warns as if the call order were wrong.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
    return hivemind.Optimizer(
        dht=dht,
        run_id=collab.run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=None if auxiliary else local_batch_size,
        params=task.optimizer_param_groups(),
        optimizer=lambda params: skip_nonfinite_steps(task.make_optimizer(params)),
        scheduler=task.make_scheduler,
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        load_state_timeout=collab.load_state_timeout,
        average_state_every=collab.average_state_every,
        use_local_updates=flags.use_local_updates,
        delay_optimizer_step=flags.delay_optimizer_step,
        delay_grad_averaging=flags.delay_grad_averaging,
        auxiliary=auxiliary,
        # hivemind 1.1.12 inverts its None check and then takes dht.client_mode only for a non-None value;
        # without it a client-mode trainer crashes at its first epoch (state_sharing_priority on a client averager)
        client_mode=dht.client_mode,
        grad_compression=compression,
        state_averaging_compression=compression,
        averager_opts=averager_opts,
        tracker_opts={"min_refresh_period": 0.2, "default_refresh_period": 1.0},
        verbose=True,  # status lines at INFO; common.lifecycle.setup_logging decides which loggers show them
    )
