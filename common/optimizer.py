"""hivemind.Optimizer built from config: semantics preset, wire compression, declared bandwidth; DiLoCo on top."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    TensorRole,
    Uniform8BitQuantization,
)
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, load_optimizer_state

from common.config import CollaborationConfig, Compression, Semantics
from common.dht import read_announced_swarm_step
from common.hivemind_compat import (
    bound_state_downloads,
    catch_up_one_step_behind,
    client_mode_argument,
    grad_buffers_for_scaler,
    gradient_rounds_start_at_the_update,
    require_installed,
    skip_nonfinite_steps,
)
from common.hivemind_patches.uploads import LIMIT_ATTRIBUTE
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
    # Local updates; every inner_steps global steps an outer step on the averaged pseudo-gradient (DiLoCoOptimizer).
    Semantics.diloco: SemanticsFlags(use_local_updates=True, delay_optimizer_step=False, delay_grad_averaging=False),
}
# diloco never averages the parameters themselves between outer steps: hivemind's state averaging "every this many
# epochs" is pushed beyond any run's length
NEVER = 2**62
OUTER_MOMENTUM = "outer_momentum"  # the served state's metadata key: how many outer momentum tensors end the state
OUTER_LINEAGE = "outer_lineage"  # the served state's metadata key: which outer steps made the outer parameters
REALIGNING_GROUP_BITS = "1"  # realigning rounds match only each other, never a pseudo-gradient round (group key "")


def next_outer_lineage(lineages: Iterable[str], epoch: int, members: Iterable[str], kind: str = "outer step") -> str:
    """The lineage of outer parameters after a round: a digest of the lineages they came from, the global step and
    the round's members. Every member of one round computes the same value, so equal lineages mean "made by the
    same outer steps"; a peer that stepped alone, or in another group, gets another one."""
    record = json.dumps([kind, int(epoch), sorted(set(lineages)), sorted(set(members))])
    return hashlib.sha256(record.encode()).hexdigest()[:16]


def missed_an_outer_step(local_epoch: int, global_epoch: int, inner_steps: int) -> bool:
    """Whether a diloco trainer at ``local_epoch`` must download the swarm's state, the swarm being at
    ``global_epoch``: hivemind's rule for a peer that fell behind (two or more global steps), applied only when
    the swarm crossed an outer step (a multiple of ``inner_steps``) since. A trainer one step behind takes its
    update and joins the outer round if one is due; one behind by more, but within the same outer period, goes on
    with its own inner steps and moves to the swarm's step at its next update."""
    crossed_an_outer_step = global_epoch // inner_steps > local_epoch // inner_steps
    return local_epoch < global_epoch - 1 and crossed_an_outer_step


def make_outer_optimizer(params: Sequence[torch.Tensor], lr: float, momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (plain SGD at momentum 0), its momentum buffers created
    up front so that they exist to be served, checkpointed and downloaded before the first outer step."""
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    return prefill_optimizer_state(optimizer)


def outer_momentum_tensors(outer_optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The outer optimizer's momentum buffers in parameter order (none at momentum 0). Read afresh each time:
    ``load_state_dict`` replaces the tensors."""
    params = [param for group in outer_optimizer.param_groups for param in group["params"]]
    return [outer_optimizer.state[param]["momentum_buffer"] for param in params if param in outer_optimizer.state]


PARTIAL_ROUND = "partial_round"  # the key OuterAverager adds to a round's gathered data when it was partial


class OuterAverager(DecentralizedAverager):
    """hivemind's averager for DiLoCo's outer rounds, which also says when a round was partial.

    When a member fails while it reduces its part of the vector (it crashed, or its link stalled past the
    timeouts), hivemind keeps each other member's own values for that part, logs one line and returns the round's
    gathered data as for a whole round. For gradients that is a one-step blemish. For outer parameters it is a
    permanent difference between members that then gather the same lineage. So a partial round adds
    ``PARTIAL_ROUND: True`` to what ``step`` returns, and the optimizer gives this peer a lineage of its own."""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        # the runner stays registered until the round's _aggregate_with_group returns
        runner = self._running_groups[group_info.group_id if group_id is None else group_id].result()
        self._last_round_partial = runner.tensor_part_container.failed_size > 0

    async def _aggregate_with_group(self, group_info, min_vector_size, **kwargs):
        self._last_round_partial = False
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {**gathered, PARTIAL_ROUND: True} if self._last_round_partial else gathered


class DiLoCoStateAverager(TrainingStateAverager):
    """hivemind's state averager for a DiLoCo peer: what it serves is the swarm's state, not this peer's drift.

    Between outer steps a trainer's parameters wander off on its own data; the state a joining peer (or the
    monitor's checkpoint) needs is the one every trainer agrees on: the *outer* parameters, the result of the last
    outer step. So the served state is hivemind's own (parameters, extra tensors such as BatchNorm statistics, the
    inner optimizer's statistics, the epoch) with the outer parameters in place of the parameters, and the outer
    optimizer's momentum appended after everything hivemind reads (its count in the metadata under
    ``OUTER_MOMENTUM``). A download is the reverse: the inner optimizer state as hivemind loads it, and both the
    parameters and the outer parameters set to the served outer parameters, so the joiner's next pseudo-gradient
    counts only its own inner steps.

    ``outer_optimizer`` holds the outer parameters (its param_groups, in the inner optimizer's parameter order) and
    their momentum. On a trainer they are CPU copies, apart from the model; on the monitor, which never trains, the
    model's own parameters (then the checkpoint's ``model`` is the outer state).
    """

    def __init__(self, *, outer_optimizer: torch.optim.Optimizer, **kwargs):
        self.outer_optimizer = outer_optimizer
        self.outer_parameters = [param for group in outer_optimizer.param_groups for param in group["params"]]
        self.outer_lineage = ""  # every fresh peer starts from the same seeded parameters
        super().__init__(**kwargs)

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        count = len(self.outer_parameters)
        with torch.no_grad(), self.lock_averaged_tensors:
            outer = [param.detach().cpu().clone() for param in self.outer_parameters]
            momentum = [buffer.detach().cpu().clone() for buffer in outer_momentum_tensors(self.outer_optimizer)]
        momentum_infos = [
            CompressionInfo.from_tensor(buffer, key=f"{OUTER_MOMENTUM}{index}", role=TensorRole.OPTIMIZER)
            for index, buffer in enumerate(momentum)
        ]
        metadata = dict(metadata, **{OUTER_MOMENTUM: len(momentum), OUTER_LINEAGE: self.outer_lineage})
        return metadata, [*outer, *tensors[count:], *momentum], [*infos, *momentum_infos]

    def load_state_from_peers(self, **kwargs):
        """hivemind's TrainingStateAverager.load_state_from_peers for the state ``get_current_state`` serves."""
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        momentum = outer_momentum_tensors(self.outer_optimizer)
        loaded = DecentralizedAverager.load_state_from_peers(self, **kwargs)
        if loaded is None:
            return
        metadata, flat = loaded
        if not isinstance(metadata.get("epoch"), int) or metadata["epoch"] < self.local_epoch:
            logger.warning("not loading a peer's state: its epoch is behind this peer's")
            return
        if metadata.get(OUTER_MOMENTUM) != len(momentum):
            logger.warning(
                f"not loading a peer's state: it carries {metadata.get(OUTER_MOMENTUM)} outer momentum tensors, "
                f"a diloco peer here has {len(momentum)} (a peer of other semantics or outer settings)"
            )
            return
        head = len(params) + len(self.extra_tensors)
        if len(flat) < head + len(momentum):
            logger.warning("not loading a peer's state: it has fewer tensors than this peer's state")
            return
        loaded_momentum = flat[len(flat) - len(momentum) :]
        with torch.no_grad(), self.lock_averaged_tensors:
            try:
                load_optimizer_state(
                    self.optimizer, metadata["optimizer_metadata"], flat[head : len(flat) - len(momentum)]
                )
            except StopIteration:
                logger.warning("not loading a peer's state: its inner optimizer statistics do not match this peer's")
                return
            for param, outer, value in zip(params, self.outer_parameters, flat[: len(params)]):
                param.copy_(value)
                outer.copy_(value)
            for tensor, value in zip(self.extra_tensors, flat[len(params) : head]):
                tensor.copy_(value)
            for buffer, value in zip(momentum, loaded_momentum):
                buffer.copy_(value)
            self.outer_lineage = str(metadata.get(OUTER_LINEAGE, ""))
        if not self.reuse_tensors:
            self._load_local_tensors_into_averager_()
        self.local_epoch = metadata["epoch"]
        self._update_scheduler()


class DiLoCoOptimizer(hivemind.Optimizer):
    """DiLoCo (Douillard et al., 2023) on hivemind, as OpenDiLoCo builds it: local updates between outer steps.

    Each trainer steps the task's optimizer (the *inner* optimizer) on its own micro-batches at every ``step``,
    hivemind's ``use_local_updates``: hivemind's progress tracker still counts the swarm's samples into global steps
    of ``target_batch_size`` and steps the learning-rate schedule once per global step, exactly as for ``sync``.
    Every ``inner_steps`` global steps, where hivemind would average the parameters, the swarm instead averages
    the *pseudo-gradient*, each trainer's outer parameters minus its current parameters (how far its inner steps
    moved it), in a hivemind all-reduce of its own (``DecentralizedAverager`` under the prefix
    ``<run_id>_outer_averager``: the same matchmaking, load balancing by declared bandwidth, wire compression,
    client mode and auxiliary peers as gradient rounds). Each trainer then applies the outer optimizer (Nesterov
    SGD) to its outer parameters with that average as gradient and copies the result into the model: all trainers
    leave an outer step with the same parameters, and the inner optimizer keeps its statistics.

    Communication: one all-reduce of the parameters' size every ``inner_steps`` global steps instead of one every
    global step. A trainer alone in the swarm, or one whose round found no group, applies its own pseudo-gradient
    (one WARNING line). Its outer parameters then have another history than the swarm's, which averaging
    pseudo-gradients alone would never undo: each round gathers the members' outer lineages, and members that find
    different ones average their outer state itself (``_realign_outer_state``). A trainer that falls a global step
    behind downloads the swarm's outer state (``DiLoCoStateAverager``), but only when it missed an outer step
    (``missed_an_outer_step``): between outer steps its parameters are its own, and the outer state it would
    download is the one it already holds.
    """

    def __init__(
        self,
        *,
        params,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        bandwidth: Optional[float],
        target_group_size: Optional[int] = None,
        **kwargs,
    ):
        self.inner_steps = inner_steps
        groups = list(params)
        flat = [param for group in groups for param in (group["params"] if isinstance(group, dict) else [group])]
        # the outer state lives on the CPU (OpenDiLoCo's offload): a GPU keeps only the model and its inner state
        outer_parameters = [param.detach().to("cpu", copy=True) for param in flat]
        self.outer_optimizer = make_outer_optimizer(outer_parameters, outer_lr, outer_momentum)
        self.outer_parameters = outer_parameters
        super().__init__(params=groups, use_local_updates=True, average_state_every=NEVER, **kwargs)
        self.outer_averager = OuterAverager(
            averaged_tensors=[torch.zeros_like(param) for param in outer_parameters],
            dht=self.dht,
            prefix=f"{self.run_id}_outer_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            next_chunk_timeout=self.next_chunk_timeout,
            compression=kwargs.get("grad_compression", NoCompression()),
            bandwidth=bandwidth,
            target_group_size=target_group_size,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            allow_state_sharing=False,  # the state averager serves the outer state
            start=True,
        )
        self.outer_steps = 0  # outer steps this peer took part in (alone or with a group)
        # whether the last outer step left this peer with the outer state of the other trainers: a whole round with
        # one lineage, or a realignment. False after a step alone or a partial round (the final parameter round of
        # common.backends then pulls the trainers together at the end of a run)
        self.outer_state_agreed = True

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        return DiLoCoStateAverager(
            outer_optimizer=self.outer_optimizer,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def _should_load_state_from_peers(self) -> bool:
        # hivemind's exact check after each update would download the state of a peer one global step behind:
        # here that state is the outer state this peer already has, and the download would drop its inner steps
        self._should_check_synchronization_on_update = False
        return missed_an_outer_step(self.local_epoch, self.tracker.global_epoch, self.inner_steps)

    def _update_global_epoch(self, grad_scaler) -> None:
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        if next_epoch // self.inner_steps > self.local_epoch // self.inner_steps:  # a multiple of H in between
            self._outer_step(next_epoch)
        super()._update_global_epoch(grad_scaler)

    def _outer_step(self, next_epoch: int) -> None:
        if self.auxiliary:  # no parameters of its own: it reduces a share of the trainers' pseudo-gradients
            try:
                self.outer_averager.step(timeout=self.averaging_timeout)
            except Exception as error:
                logger.warning(f"outer step before global step {next_epoch}: no round to assist ({error!r})")
            return
        params = [param for group in self.param_groups for param in group["params"]]
        with torch.no_grad():
            pseudo_gradients = [outer - param.detach().cpu() for outer, param in zip(self.outer_parameters, params)]
        averaged, lineages, partial = pseudo_gradients, {}, False
        if self.tracker.global_progress.num_peers > 1:
            # no group within the timeout, or a partner failed: this peer steps on its own
            gathered, partial = self._outer_round(pseudo_gradients, "outer averaging")
            if gathered and len(gathered) > 1:
                lineages = {str(peer): lineage for peer, lineage in gathered.items() if lineage is not None}
                with self.outer_averager.get_tensors() as tensors:
                    averaged = [tensor.clone() for tensor in tensors]
        partners = max(len(lineages) - 1, 0)  # auxiliary peers gather no lineage: they are not counted
        if not lineages and self.tracker.global_progress.num_peers > 1:
            logger.warning(
                f"outer step before global step {next_epoch} used this peer's pseudo-gradient only: its averaging "
                f"round found no group (its parameters now differ from the swarm's until a later round realigns "
                f"them)"
            )
        with torch.no_grad(), self.state_averager.lock_averaged_tensors:
            for outer, pseudo_gradient in zip(self.outer_parameters, averaged):
                outer.grad = pseudo_gradient
            self.outer_optimizer.step()
            for outer, param in zip(self.outer_parameters, params):
                outer.grad = None
                param.copy_(outer)
        own = self.state_averager.outer_lineage
        mixed = len(set(lineages.values())) > 1
        self.state_averager.outer_lineage = next_outer_lineage(
            lineages.values() or [own], next_epoch, lineages.keys() or [str(self.dht.peer_id)]
        )
        if partial:  # some parts kept this peer's own values: a history no other member shares
            logger.warning(
                f"outer step before global step {next_epoch}: a member of the round failed, so part of the "
                f"pseudo-gradient was this peer's own (the next round realigns the outer state)"
            )
            self.state_averager.outer_lineage = next_outer_lineage(
                [self.state_averager.outer_lineage], next_epoch, [str(self.dht.peer_id)], kind="partial round"
            )
        self.outer_steps += 1
        self.outer_state_agreed = bool(lineages) and not partial
        logger.log(
            self.status_loglevel,
            f"outer step before global step {next_epoch}: pseudo-gradient averaged with {partners} other peer(s)",
        )
        if mixed:
            self._realign_outer_state(next_epoch)

    def _realign_outer_state(self, next_epoch: int) -> None:
        """Average the outer parameters and the outer momentum themselves, with the other peers that found in the
        same round that their outer parameters have different histories.

        Averaging pseudo-gradients keeps the swarm together only while every trainer starts each outer step from
        the same outer parameters: a trainer that stepped alone (its round failed, or its progress tracker had not
        seen the others yet) or in another group applies a different update, and from then on every averaged
        pseudo-gradient moves it and the others by the same amount, so the difference would stay for good. Each
        round therefore gathers every member's outer lineage (``next_outer_lineage``); members who see more than
        one lineage in their round average their outer state in rounds of their own (group key bits
        ``REALIGNING_GROUP_BITS``: they never mix with a pseudo-gradient round), one for the parameters and one for
        the momentum, at the cost of two parameter-sized rounds only when it happens. A realigning round that finds
        no partner leaves the state as it is and gives this peer a lineage of its own: the next outer round finds
        the difference again."""
        realigned = {}
        try:
            for state in (self.outer_parameters, outer_momentum_tensors(self.outer_optimizer)):
                if not state:  # no momentum buffers at outer_momentum 0
                    continue
                members = self._average_in_a_realigning_round(state)
                if len(members) < 2:
                    logger.warning(
                        f"outer state before global step {next_epoch} not realigned: the round found no partner or "
                        f"a member failed in it"
                    )
                    # a lineage of its own, so that the next outer round finds the difference again
                    self.state_averager.outer_lineage = next_outer_lineage(
                        [self.state_averager.outer_lineage], next_epoch, [str(self.dht.peer_id)], kind="not realigned"
                    )
                    self.outer_state_agreed = False
                    return
                realigned = realigned or members
        finally:
            params = [param for group in self.param_groups for param in group["params"]]
            with torch.no_grad(), self.state_averager.lock_averaged_tensors:
                for outer, param in zip(self.outer_parameters, params):
                    param.copy_(outer)
        self.state_averager.outer_lineage = next_outer_lineage(
            realigned.values(), next_epoch, realigned.keys(), kind="realigned"
        )
        self.outer_state_agreed = True
        logger.warning(
            f"outer state before global step {next_epoch}: realigned with {len(realigned) - 1} other peer(s) whose "
            f"outer parameters had another history"
        )

    def _outer_round(self, values: Sequence[torch.Tensor], what: str):
        """One round of the outer averager on ``values`` (copied into its tensors), gathering this peer's lineage:
        the gathered lineages by peer (None when the round failed) and whether the round was partial."""
        with self.outer_averager.get_tensors() as tensors:
            for tensor, value in zip(tensors, values):
                tensor.copy_(value)
        try:
            gathered = self.outer_averager.step(
                weight=1.0, gather=self.state_averager.outer_lineage, timeout=self.averaging_timeout
            )
        except Exception as error:
            logger.debug(f"{what} round failed: {error!r}")
            return None, False
        partial = bool(gathered and gathered.pop(PARTIAL_ROUND, False))
        return gathered, partial

    def _average_in_a_realigning_round(self, state: List[torch.Tensor]) -> dict:
        """Average ``state`` in place with the peers of one realigning round; returns the members' lineages (none
        when the round failed, and then ``state`` is left as it was)."""
        # set before every round: hivemind moves an averager's group bits after each group it assembles
        self.outer_averager.set_group_bits(REALIGNING_GROUP_BITS)
        try:
            gathered, partial = self._outer_round(state, "realigning")
        finally:
            self.outer_averager.set_group_bits("")
        if partial:
            return {}  # part of the state would stay this peer's own: as good as no round
        members = {str(peer): lineage for peer, lineage in (gathered or {}).items() if lineage is not None}
        if len(members) >= 2:
            with (
                torch.no_grad(),
                self.state_averager.lock_averaged_tensors,
                self.outer_averager.get_tensors() as tensors,
            ):
                for tensor, value in zip(tensors, state):
                    value.copy_(tensor)
        return members

    def shutdown(self) -> None:
        if self.outer_averager.is_alive():
            self.outer_averager.shutdown()
        super().shutdown()


def group_options(collab: CollaborationConfig) -> dict:
    """The averagers' group cap (``collaboration.target_group_size``): hivemind's default when unset."""
    return {} if collab.target_group_size is None else {"target_group_size": collab.target_group_size}


def state_serving_options(collab: CollaborationConfig) -> dict:
    """A state averager's upload limit (``collaboration.max_concurrent_state_uploads``, enforced by the patch
    ``limit_concurrent_state_uploads``); without one the keyword is left out, as hivemind's own averager knows none."""
    limit = collab.max_concurrent_state_uploads
    return {} if limit is None else {LIMIT_ATTRIBUTE: limit}


def make_collaborative_optimizer(
    dht: hivemind.DHT,
    task: Task,
    collab: CollaborationConfig,
    local_batch_size: Optional[int],
    auxiliary: bool = False,
    uses_grad_scaler: bool = False,
    stop_requested: Optional[Callable[[], bool]] = None,
    *,
    run_id: Optional[str] = None,
    bandwidth: Optional[float] = None,
) -> hivemind.Optimizer:
    """The task's optimizer wrapped in hivemind.Optimizer; ``auxiliary`` peers only help average.
    ``uses_grad_scaler``: the trainer steps it with a ``hivemind.GradScaler`` (fp16). Its state downloads give up
    after ``collab.load_state_deadline`` seconds; ``stop_requested`` (the stop flag) cuts their retries short.
    ``run_id``: the prefix of the averagers' DHT keys, ``collab.run_id`` unless a moderated run tags it with its
    secret (``common.auth.averaging_run_id``); the run's records keep ``collab.run_id``. ``bandwidth``: the Mbit/s
    declared to the load balancer when measured (``common.peer.link_bandwidth``), else ``collab.bandwidth``."""
    run_id = run_id if run_id is not None else collab.run_id
    bandwidth = bandwidth if bandwidth is not None else collab.bandwidth
    flags = SEMANTICS[collab.semantics]
    diloco = collab.semantics == Semantics.diloco
    compression = make_compression(collab.compression)
    # the state is prefilled (prefill_optimizer_state), so hivemind's own virtual zero-gradient step and its log line
    # must not run
    state_averager_opts = dict(
        initialize_optimizer=False, bandwidth=bandwidth, **group_options(collab), **state_serving_options(collab)
    )
    # hivemind 1.1.12 hands averager_opts to the state averager only: the declared bandwidth and the group cap reach
    # the gradient averager, whose rounds they shape, through the factory.
    grad_averager_factory = None  # local updates average parameters only: hivemind makes no gradient averager
    if not flags.use_local_updates:
        grad_averager_factory = functools.partial(GradientAverager, bandwidth=bandwidth, **group_options(collab))
    require_installed()  # start_dht installed the process-wide patches, before the averagers are forked
    optimizer_class, diloco_options = hivemind.Optimizer, {}
    if diloco:
        optimizer_class = DiLoCoOptimizer
        diloco_options = dict(
            inner_steps=collab.inner_steps,
            outer_lr=collab.outer_lr,
            outer_momentum=collab.outer_momentum,
            bandwidth=bandwidth,
            target_group_size=collab.target_group_size,
        )
    optimizer = optimizer_class(
        dht=dht,
        run_id=run_id,
        target_batch_size=collab.target_batch_size,
        batch_size_per_step=None if auxiliary else local_batch_size,
        params=task.optimizer_param_groups(),
        optimizer=lambda params: skip_nonfinite_steps(prefill_optimizer_state(task.make_optimizer(params))),
        scheduler=task.make_scheduler,
        matchmaking_time=collab.matchmaking_time,
        averaging_timeout=collab.averaging_timeout,
        next_chunk_timeout=collab.next_chunk_timeout,
        load_state_timeout=collab.load_state_timeout,
        **({} if diloco else dict(average_state_every=collab.average_state_every)),
        **({} if diloco else dict(use_local_updates=flags.use_local_updates)),
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
        tracker_opts={
            "min_refresh_period": collab.progress_poll_min_seconds,
            "default_refresh_period": collab.progress_poll_max_seconds,
            "metadata_expiration": collab.progress_expiration,
        },
        verbose=True,  # status lines at INFO; common.lifecycle.setup_logging decides which loggers show them
        **diloco_options,
    )
    bound_state_downloads(
        optimizer,
        collab.load_state_deadline,
        stop_requested or (lambda: False),
        announced_step=functools.partial(read_announced_swarm_step, dht, collab.run_id),
        holders_gone_after=collab.progress_expiration,
    )
    if collab.catch_up_one_step_behind and not diloco:  # diloco has its own rule (missed_an_outer_step)
        catch_up_one_step_behind(optimizer)
    if flags.delay_grad_averaging:
        gradient_rounds_start_at_the_update(optimizer)
    return optimizer


def make_checkpoint_state_averager(
    dht: hivemind.DHT, task: Task, collab: CollaborationConfig, prefix: str
) -> TrainingStateAverager:
    """The monitor's state averager: it downloads the trainers' state (the ``prefix`` they serve under) and serves
    its checkpoint. For ``diloco`` it holds the outer optimizer's momentum beside the task's optimizer, and its
    model parameters are the outer parameters (``DiLoCoStateAverager``)."""
    options = dict(
        dht=dht,
        optimizer=task.make_optimizer,
        params=task.optimizer_param_groups(),
        scheduler=task.make_scheduler,
        prefix=prefix,
        min_matchmaking_time=collab.matchmaking_time,
        extra_tensors=averaged_buffers(task.model),  # the trainers' BatchNorm statistics
        start=True,
        **state_serving_options(collab),  # it serves its checkpoint to newcomers like any donor
    )
    if collab.semantics != Semantics.diloco:
        return TrainingStateAverager(**options)
    outer_parameters = [param for group in options["params"] for param in group["params"]]
    outer_optimizer = make_outer_optimizer(outer_parameters, collab.outer_lr, collab.outer_momentum)
    return DiLoCoStateAverager(outer_optimizer=outer_optimizer, **options)


def outer_checkpoint_state(averager: TrainingStateAverager) -> dict:
    """What a checkpoint holds beyond the model, inner optimizer and schedule: the outer optimizer's state (diloco)."""
    if isinstance(averager, DiLoCoStateAverager):
        return {"outer_optimizer": averager.outer_optimizer.state_dict()}
    return {}


def load_outer_checkpoint_state(averager: TrainingStateAverager, state: dict) -> None:
    if isinstance(averager, DiLoCoStateAverager) and state.get("outer_optimizer") is not None:
        averager.outer_optimizer.load_state_dict(state["outer_optimizer"])
