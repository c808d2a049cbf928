"""hivemind.Optimizer built from config: semantics preset, wire compression, declared bandwidth."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

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
    averager_opts = {"bandwidth": collab.bandwidth} if collab.bandwidth is not None else {}
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
        optimizer=lambda params: skip_nonfinite_steps(task.make_optimizer(params)),
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
        averager_opts=averager_opts,
        tracker_opts={"min_refresh_period": 0.2, "default_refresh_period": 1.0},
        verbose=True,  # status lines at INFO; common.lifecycle.setup_logging decides which loggers show them
    )
    bound_state_downloads(optimizer, collab.load_state_deadline, stop_requested or (lambda: False))
    if collab.catch_up_one_step_behind:
        catch_up_one_step_behind(optimizer)
    if flags.delay_grad_averaging:
        gradient_rounds_start_at_the_update(optimizer)
    return optimizer
