"""hivemind.Optimizer built from config: semantics preset, wire compression, declared bandwidth."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, List, Optional

import hivemind
import torch
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)
from hivemind.optim.grad_averager import GradientAverager

from common.config import CollaborationConfig, Compression, Semantics
from common.hivemind_compat import (
    bound_state_downloads,
    catch_up_one_step_behind,
    client_mode_argument,
    grad_buffers_for_scaler,
    gradient_rounds_start_at_the_update,
    keep_inbound_stream_handlers_alive,
    read_8bit_tensors_with_numpy_2,
    silence_schedule_fast_forward_warning,
    skip_nonfinite_steps,
    stream_results_to_zero_share_full_peers,
)
from common.task import Task

logger = logging.getLogger(__name__)


def prefill_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Create ``optimizer``'s state exactly as it stands before its first real step, for any torch optimizer.

    hivemind needs every optimizer statistic to exist before training (it averages and serves them as tensors).
    Left alone, it creates them with one virtual step on zero gradients, at the base learning rate: with weight
    decay that step shrinks the weights, and it advances the step counters, so a swarm would no longer match one
    process. Here the same zero-gradient step runs without weight decay, then the parameters are restored bit for bit
    and every step counter (``step`` in a parameter's state or a param group, e.g. torch's AdamW, timm's LAMB) is set
    back to zero, which is what the optimizer's own first step would find. An optimizer that keeps no state (SGD
    without momentum) is left as it is. Exact for every optimizer whose first step treats zero statistics like
    missing ones (Adam/AdamW, LAMB, LARS and SGD with momentum but no dampening).
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved_params = [param.detach().clone() for param in params]
    saved_grads = [param.grad for param in params]
    saved_groups = [dict(group) for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        if "weight_decay" in group:  # torch's SGD and Adam fold decay into the gradient, and so into their state
            group["weight_decay"] = 0.0
    optimizer.step()
    with torch.no_grad():
        for param, saved, grad in zip(params, saved_params, saved_grads):
            param.copy_(saved)
            param.grad = grad
    for group, saved in zip(optimizer.param_groups, saved_groups):
        for key in list(group):
            if key == "step":
                group[key] = _zero_counter(group[key])
            elif key in saved:
                group[key] = saved[key]
    for param in params:
        state = optimizer.state.get(param)
        if state and "step" in state:
            state["step"] = _zero_counter(state["step"])
    return optimizer


def _zero_counter(counter):
    return torch.zeros_like(counter) if isinstance(counter, torch.Tensor) else type(counter)(0)


def averaged_buffers(model: torch.nn.Module) -> List[torch.Tensor]:
    """The model's floating-point buffers (BatchNorm's running means and variances), in module order.

    They are not parameters, so hivemind averages them only when handed over as ``extra_tensors``: then every state
    averaging round averages them like the parameters, and a state download (a late joiner, the monitor's
    checkpoint) carries them. Without that each trainer keeps the statistics of its own batches and the monitor,
    which never runs a forward pass, checkpoints the initial ones. Integer buffers (BatchNorm's batch counters,
    position ids) stay local: they are not meaningful averages.
    """
    return [buffer for buffer in model.buffers() if buffer.is_floating_point()]


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
    uses_grad_scaler: bool = False,
    stop_requested: Optional[Callable[[], bool]] = None,
) -> hivemind.Optimizer:
    """The task's optimizer wrapped in hivemind.Optimizer; ``auxiliary`` peers only help average.
    ``uses_grad_scaler``: the trainer steps it with a ``hivemind.GradScaler`` (fp16). Its state downloads give up
    after ``collab.load_state_deadline`` seconds; ``stop_requested`` (the stop flag) cuts their retries short."""
    flags = SEMANTICS[collab.semantics]
    compression = make_compression(collab.compression)
    # the state is prefilled (prefill_optimizer_state), so hivemind's own virtual zero-gradient step and its log line
    # must not run
    state_averager_opts = {"initialize_optimizer": False, "bandwidth": collab.bandwidth}
    # hivemind 1.1.12 hands averager_opts to the state averager only: the declared bandwidth reaches the gradient
    # averager, whose rounds it load-balances, through the factory.
    grad_averager_factory = None  # local updates average parameters only: hivemind makes no gradient averager
    if not flags.use_local_updates:
        grad_averager_factory = functools.partial(GradientAverager, bandwidth=collab.bandwidth)
    silence_schedule_fast_forward_warning()
    stream_results_to_zero_share_full_peers()  # before the averagers' processes are forked
    keep_inbound_stream_handlers_alive()
    read_8bit_tensors_with_numpy_2()
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id=collab.run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=None if auxiliary else local_batch_size,
        params=task.optimizer_param_groups(),
        optimizer=lambda params: skip_nonfinite_steps(prefill_optimizer_state(task.make_optimizer(params))),
        scheduler=task.make_scheduler,
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        next_chunk_timeout=collab.next_chunk_timeout,
        load_state_timeout=collab.load_state_timeout,
        average_state_every=collab.average_state_every,
        use_local_updates=flags.use_local_updates,
        delay_optimizer_step=flags.delay_optimizer_step,
        delay_grad_averaging=flags.delay_grad_averaging,
        reuse_grad_buffers=grad_buffers_for_scaler(uses_grad_scaler, flags.use_local_updates),
        auxiliary=auxiliary,
        client_mode=client_mode_argument(dht),
        grad_compression=compression,
        state_averaging_compression=compression,
        averager_opts=state_averager_opts,
        grad_averager_factory=grad_averager_factory,
        extra_tensors=averaged_buffers(task.model),
        tracker_opts={"min_refresh_period": 0.2, "default_refresh_period": 1.0},
        verbose=True,  # status lines at INFO; common.lifecycle.setup_logging decides which loggers show them
    )
    bound_state_downloads(optimizer, collab.load_state_deadline, stop_requested or (lambda: False))
    if collab.catch_up_one_step_behind:
        catch_up_one_step_behind(optimizer)
    if flags.delay_grad_averaging:
        gradient_rounds_start_at_the_update(optimizer)
    return optimizer
