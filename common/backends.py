"""Backends of the one training loop: how accumulated gradients become a global optimizer step.

* ``SingleProcessBackend``: one process accumulates ``target_batch_size`` samples, then steps.
* ``CollaborativeBackend``: hivemind peers; the swarm together accumulates the target batch.
* ``DDPBackend`` (``common/ddp.py``): the HPC baseline.

All of them weigh micro-batch gradients by micro-batch size, so with equal micro-batches the step is the
mean gradient over every sample of the global batch, and step the scheduler once per global step.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from common.config import CollaborationConfig, Semantics
from common.errors import ConfigError, PeerError, UserError
from common.hivemind_compat import count_state_reloads, restart_throughput_timer, software_fingerprint
from common.metrics import (
    HistoryWriter,
    PeerMetrics,
    StepRecord,
    aggregate_step,
    metrics_key,
    records_to_publish,
)
from common.precision import Precision
from common.task import Task

logger = logging.getLogger(__name__)
PUBLISH_TIMEOUT = 10.0  # seconds a leaving trainer waits for its last metrics record to reach the DHT
# The last trainer to reach the start barrier passes it at once, the others at their next poll, so the poll interval
# bounds how far apart they start. One that starts late is not yet looking for a group when the first gradient round
# forms; its gradients then wait for the next group, which averages the following step.
BARRIER_POLL_SECONDS = 0.1
BARRIER_ANNOUNCE_SECONDS = 1.0  # how often a waiting trainer renews its "I am here" record


class TrainingBackend(abc.ABC):
    state_reloads: int = 0  # times this process replaced its state with the swarm's (discarding local work)
    overflow_discards: int = 0  # times an fp16 overflow discarded the gradients accumulated for the step in progress
    # the fp16 loss scaler (common/precision.py); while it is set, it and not the loop judges gradients' finiteness
    grad_scaler: Optional[torch.amp.GradScaler] = None

    @property
    @abc.abstractmethod
    def global_step(self) -> int:
        """Number of global optimizer steps the run has completed (as this peer knows it)."""

    @abc.abstractmethod
    def step(self, batch_size: int) -> Optional[int]:
        """Account for one backpropagated micro-batch; return the finished global step's index, if any."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Called after every micro-batch: clear gradients this backend does not keep for its next step."""

    @property
    def worker_label(self) -> Optional[str]:
        """Distinguishes the processes of one multi-process baseline run (DDP workers); None otherwise."""
        return None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward passes through (DDP wraps it)."""
        return model

    def micro_step_context(self):
        """Context around one micro-batch's forward and backward (DDP skips all-reduces in it)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss (multiplied by the loss scale under fp16)."""
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    @property
    def loss_scale(self) -> Optional[float]:
        return self.grad_scaler.get_scale() if self.grad_scaler is not None else None

    def checkpoint_state(self) -> Optional[dict]:
        """What a baseline (single, DDP) checkpoint holds at a global-step boundary; None: this process saves
        none (collaborative peers: the monitor checkpoints the swarm; DDP workers other than rank 0)."""
        return None

    def load_checkpoint_state(self, state: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not resume from checkpoints")

    def publish(self, records: List[StepRecord]) -> None:
        """Share this peer's recent step records (collaborative backends only)."""

    def finalize(self, wait: bool = True) -> None:
        """Make the model hold the run's final parameters (collaborative: apply the last state averaging).
        ``wait=False``: the peer was stopped by a signal; do not wait for a round still in progress."""

    def average_final_parameters(self) -> None:
        """The run is over: end with the same parameters as the trainers that finish with this one (collaborative
        backends only; the others' workers end identical)."""

    def recover_from_nonfinite_parameters(self) -> None:
        """Parameters became NaN/Inf after a step. Without peers to restore from, stop with a clear error."""
        raise UserError(
            f"parameters became non-finite at global step {self.global_step}: lower the learning "
            f"rate or enable gradient clipping; the last checkpoint is unaffected"
        )

    def swarm_status(self) -> Optional[SwarmStatus]:
        """What the swarm looks like from this peer (collaborative backends only)."""
        return None

    def shutdown(self) -> None: ...


@dataclass
class SwarmStatus:
    peers: int  # trainers hivemind's progress tracker sees (this one included)
    samples_per_second: float  # the swarm's rate, from its global progress since this peer's last look


def load_baseline_state(model, optimizer, scheduler, grad_scaler, state: dict) -> None:
    """Restore a single/DDP checkpoint (``checkpoint_state``) into freshly built training objects."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if grad_scaler is not None and state.get("grad_scaler") is not None:
        grad_scaler.load_state_dict(state["grad_scaler"])


class SingleProcessBackend(TrainingBackend):
    """Plain PyTorch: accumulate sample-weighted gradients until ``collab.target_batch_size``, then step.

    ``collab.semantics=dpu``: apply each global step's gradient one global step late, as a ``dpu`` swarm does (its
    peers compute step k's gradients while step k-1 is averaged and applied in the background). One process with
    the same staleness is the reference that tells the algorithm's cost from the swarm's."""

    def __init__(
        self,
        task: Task,
        collab: CollaborationConfig,
        precision: Precision = Precision.fp32,
        history_dir: Optional[Path] = None,
    ):
        """``precision``: the run context's (``common.context.RunContext``); fp16 gives this backend torch's
        loss scaler."""
        # a replay (tests/helpers.py) sets it per step to the samples the swarm's step held
        self.task, self.target_batch_size = task, collab.target_batch_size
        delayed_updates = collab.semantics == Semantics.dpu
        device = next(task.model.parameters()).device
        self.grad_scaler = torch.amp.GradScaler(device.type) if precision.loss_scaling else None
        if delayed_updates and self.grad_scaler is not None:
            # a held-back gradient would be unscaled with a loss scale chosen after it was computed
            raise ConfigError(
                "training.backend=single with collaboration.semantics=dpu needs training.precision fp32 or bf16, "
                f"not {precision}"
            )
        self.delayed_updates = delayed_updates
        self.pending_gradients: Optional[List[torch.Tensor]] = None  # delayed_updates: the last step's, unapplied
        self.history = HistoryWriter(history_dir) if history_dir is not None else None
        self.params = [param for param in task.model.parameters() if param.requires_grad]
        self.optimizer = task.make_optimizer(task.optimizer_param_groups())
        self.scheduler = task.make_scheduler(self.optimizer)
        self.accumulators = [torch.zeros_like(param) for param in self.params]
        self.samples_accumulated = 0
        self._global_step = 0

    @property
    def global_step(self) -> int:
        return self._global_step

    def step(self, batch_size: int) -> Optional[int]:
        with torch.no_grad():
            for param, accumulator in zip(self.params, self.accumulators):
                if param.grad is not None:
                    accumulator.add_(param.grad, alpha=float(batch_size))
        self.samples_accumulated += batch_size
        if self.samples_accumulated < self.target_batch_size:
            return None
        with torch.no_grad():
            gradients = [accumulator / self.samples_accumulated for accumulator in self.accumulators]
            for accumulator in self.accumulators:
                accumulator.zero_()
        if self.delayed_updates:  # this step applies the previous step's gradient and holds back its own
            gradients, self.pending_gradients = self.pending_gradients, gradients
        if gradients is not None:
            self._apply_gradients(gradients)
        self.samples_accumulated = 0
        finished = self._global_step
        self._global_step += 1
        return finished

    def _apply_gradients(self, gradients: List[torch.Tensor]) -> None:
        for param, gradient in zip(self.params, gradients):
            param.grad = gradient
        if self.grad_scaler is None:
            self.optimizer.step()
        else:  # torch's rule: unscale, and skip the step if any gradient of the global batch is not finite
            scale_before = self.grad_scaler.get_scale()
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
            if self.grad_scaler.get_scale() < scale_before:
                self.overflow_discards += 1
                logger.warning(
                    f"fp16 overflow: global step {self._global_step} skipped, loss scale "
                    f"{scale_before:g} -> {self.grad_scaler.get_scale():g}"
                )
        if self.scheduler is not None:
            self.scheduler.step()

    def finalize(self, wait: bool = True) -> None:
        # a dpu peer's finalize applies its last background update, so the run ends with every step's gradient applied
        if self.pending_gradients is not None:
            self._apply_gradients(self.pending_gradients)
            self.pending_gradients = None

    def checkpoint_state(self) -> Optional[dict]:
        return {
            "step": self._global_step,
            "model": self.task.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "pending_gradients": self.pending_gradients,
        }

    def load_checkpoint_state(self, state: dict) -> None:
        load_baseline_state(self.task.model, self.optimizer, self.scheduler, self.grad_scaler, state)
        self._global_step = int(state["step"])
        self.pending_gradients = state.get("pending_gradients")

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def publish(self, records: List[StepRecord]) -> None:
        if self.history is not None and records:
            self.history.write(aggregate_step(records[-1].step, {"single": records[-1]}))


class CollaborativeBackend(TrainingBackend):
    """A hivemind peer: ``hivemind.Optimizer`` decides when the swarm has the target batch."""

    def __init__(
        self,
        dht: hivemind.DHT,
        optimizer: hivemind.Optimizer,
        collab: CollaborationConfig,
        peer_name: str,
        role: str,
        metrics_expiration: float,
        fingerprints: RunFingerprints,
        grad_scaler: Optional[hivemind.GradScaler] = None,
    ):
        """``grad_scaler``: fp16 only; the optimizer must then reuse the model's gradient buffers
        (``hivemind_compat.grad_buffers_for_scaler``)."""
        self.dht, self.optimizer, self.collab = dht, optimizer, collab
        self.grad_scaler = grad_scaler
        self.fingerprints = fingerprints
        self.peer_name, self.role, self.metrics_expiration = peer_name, role, metrics_expiration
        self.public_key = RSASignatureValidator().local_public_key  # the process-wide key signs our records
        self.state_reloads = 0
        self.last_publish: Optional[Future] = None
        self._last_progress: Optional[tuple] = None  # (time, samples the swarm had processed), for swarm_status
        count_state_reloads(optimizer, self._count_reload)

    def _count_reload(self) -> None:
        self.state_reloads += 1

    @property
    def global_step(self) -> int:
        return self.optimizer.local_epoch

    def step(self, batch_size: int) -> Optional[int]:
        epoch_before, reloads_before = self.optimizer.local_epoch, self.state_reloads
        if self.grad_scaler is None:
            self.optimizer.step(batch_size=batch_size)
        else:
            # hivemind's protocol: step with the scaler, then update it (it lowers the scale after an overflow and
            # raises it only right after a global step)
            scale_before = self.grad_scaler.get_scale()
            self.optimizer.step(batch_size=batch_size, grad_scaler=self.grad_scaler)
            self.grad_scaler.update()
            accumulating = self.optimizer.grad_averager is not None  # not local updates, which step per micro-batch
            if (
                self.grad_scaler.get_scale() < scale_before
                and accumulating
                and self.optimizer.local_epoch == epoch_before
            ):
                self.overflow_discards += 1
                logger.warning(
                    f"fp16 overflow at global step {epoch_before}: this peer's gradients for the step were "
                    f"discarded, loss scale {scale_before:g} -> {self.grad_scaler.get_scale():g}"
                )
                return None  # hivemind dropped what this peer accumulated: the loop starts a fresh step record
        if self.state_reloads != reloads_before:
            return None  # our accumulated micro-batches were discarded: the loop starts a fresh step record
        if self.optimizer.local_epoch == epoch_before:
            return None
        if self.collab.expected_peers > 1 and self.optimizer.tracker.global_progress.num_peers <= 1:
            # hivemind only averages with peers its progress tracker has seen; steps much shorter than its
            # refresh period (about a second) can end before that, and then only local gradients are applied
            logger.warning(
                f"global step {epoch_before} used this peer's gradients only: no other trainer was "
                f"visible yet (raise collaboration.target_batch_size if steps take only a second or two)"
            )
        return epoch_before

    def zero_grad(self) -> None:
        if self.optimizer.grad_averager is not None and self.optimizer.grad_averager.reuse_grad_buffers:
            return  # the model's .grad buffers are hivemind's accumulators: it clears them after each step itself
        self.optimizer.zero_grad()

    def publish(self, records: List[StepRecord]) -> None:
        value = PeerMetrics(
            peer_name=self.peer_name,
            role=self.role,
            recent=records_to_publish(records, self.metrics_expiration),
            model_fingerprint=self.fingerprints.model,
            input_fingerprint=self.fingerprints.inputs,
            software_fingerprint=self.fingerprints.software,
        )
        self.last_publish = self.dht.store(
            key=metrics_key(self.collab.run_id),
            subkey=self.public_key,
            value=value.dict(),
            expiration_time=get_dht_time() + self.metrics_expiration,
            return_future=True,
        )
        if self.fingerprints.averaging:  # renewed with every record, so a run's settings never expire while it runs
            publish_averaging_settings(
                self.dht, self.collab.run_id, self.peer_name, self.fingerprints.averaging, self.metrics_expiration
            )

    def swarm_status(self) -> Optional[SwarmStatus]:
        progress = self.optimizer.tracker.global_progress
        # finished epochs count whole target batches; the current one what the peers report so far
        now, processed = time.time(), progress.epoch * self.collab.target_batch_size + progress.samples_accumulated
        previous, self._last_progress = self._last_progress, (now, processed)
        if previous is None or now <= previous[0]:
            return None
        return SwarmStatus(progress.num_peers, max(0.0, processed - previous[1]) / (now - previous[0]))

    def wait_for_swarm(self, stop_requested) -> None:
        """Start barrier: wait until ``expected_peers`` trainers report, so nobody races ahead alone."""
        expected, deadline = self.collab.expected_peers, time.monotonic() + self.collab.start_barrier_timeout
        last_log = last_announcement = 0.0
        while not stop_requested():
            if time.monotonic() - last_announcement > BARRIER_ANNOUNCE_SECONDS:
                self.publish([])  # hivemind's tracker shows a peer only once it has samples: announce ourselves
                last_announcement = time.monotonic()
            trainers = count_trainers(self.dht, self.collab.run_id)
            if trainers >= expected:
                logger.info(f"start barrier passed: {trainers} trainers visible")
                break
            if time.monotonic() > deadline:
                logger.warning(f"start barrier timed out with {trainers}/{expected} trainers visible; training anyway")
                break
            if time.monotonic() - last_log > 5:
                logger.info(f"waiting for peers: {trainers}/{expected} trainers visible")
                last_log = time.monotonic()
            time.sleep(BARRIER_POLL_SECONDS)
        restart_throughput_timer(self.optimizer)
        self.swarm_status()  # the first progress report then has a swarm rate to show

    def catch_up(self) -> None:
        """Load the newest state any peer shares: a late joiner gets the swarm's parameters, optimizer state and
        step; a new swarm gets the monitor's checkpoint. (In a fresh swarm everyone is at step 0: a no-op.)"""
        self.optimizer.load_state_from_peers()
        if self.optimizer.local_epoch > 0:
            logger.info(f"loaded the swarm's state: continuing from global step {self.optimizer.local_epoch}")

    def recover_from_nonfinite_parameters(self) -> None:
        """Discard the broken local state and download the swarm's; if that is broken too (the whole swarm
        diverged), stop with a clear error rather than train on NaN: restart from the monitor's checkpoint."""
        self.optimizer.load_state_from_peers()
        if not all(
            bool(torch.isfinite(param).all()) for group in self.optimizer.param_groups for param in group["params"]
        ):
            raise UserError(
                f"the swarm's parameters are not finite at global step {self.global_step}: restart the "
                f"swarm from the monitor's last checkpoint (it saves finite states only)"
            )

    def finalize(self, wait: bool = True) -> None:
        # Wait for the last step's background parameter averaging and copy its result into the model. A peer stopped
        # by a signal applies that round only if it already finished: its partners are usually being stopped too, so
        # the round will find no group (hivemind's Optimizer.shutdown still waits for it, up to averaging_timeout)
        self.optimizer.state_averager.step(wait_for_delayed_updates=wait, apply_delayed_updates=True)

    def average_final_parameters(self) -> None:
        # hivemind's group keys carry no step, so a trainer's last rounds can join the others' rounds for the previous
        # step and it ends one update apart from them; mid-run the next parameter round pulls trainers together, at
        # the end only this one does. The group forms when the first finisher's wait ends: later finishers join it
        seconds = self.collab.final_averaging_seconds
        if seconds <= 0 or self.optimizer.tracker.global_progress.num_peers <= 1:
            return
        if self.collab.semantics == Semantics.diloco and self.global_step % self.collab.inner_steps == 0:
            if self.optimizer.outer_state_agreed:
                return  # the run ended on a whole outer round: every trainer holds the same outer parameters
            # a partial last round (a member left while it reduced its share) left each trainer its own values there
        logger.info(f"averaging the final parameters with the trainers that finish now (up to {seconds:g} s)")
        averager = self.optimizer.state_averager
        control = averager.schedule_step(
            scheduled_time=get_dht_time() + seconds, timeout=seconds + self.collab.averaging_timeout
        )
        # partners that already left leave no group to find: hivemind would look on until the round's timeout and
        # then log an error with a traceback, so give up quietly halfway there (joining late, on a busy machine,
        # can take a few seconds past the scheduled time)
        give_up = threading.Timer(
            seconds + self.collab.averaging_timeout / 2, lambda: control.began_allreduce or control.cancel()
        )
        give_up.start()
        try:
            averager.step(averaging_round=True, averaging_control=control)
        finally:
            give_up.cancel()

    def shutdown(self) -> None:
        # the last step's record is stored in the background; without waiting, a trainer that exits right after
        # its final step can take it down with its DHT and the monitor never records that step
        if self.last_publish is not None:
            try:
                self.last_publish.result(timeout=PUBLISH_TIMEOUT)
            except Exception as error:  # shutting down anyway: the record is only lost from the monitor's history
                logger.warning(f"could not publish the last step's metrics before leaving: {error!r}")
        self.optimizer.shutdown()
        self.dht.shutdown()


@dataclass(frozen=True)
class RunFingerprints:
    """What hivemind silently assumes every trainer of a run shares: the model's parameter layout (names, shapes,
    dtypes), the meaning of its inputs (``Task.input_fingerprint``) and the software that averages (hivemind's
    release and our patches over it, some of which change what goes over the wire)."""

    model: str
    inputs: str = ""
    software: str = field(default_factory=software_fingerprint)
    # how the swarm forms its updates (``averaging_settings``): diloco peers must agree on H and the outer optimizer
    # (other settings would average pseudo-gradients of other lengths), and never mix with gradient averaging
    averaging: str = ""

    @classmethod
    def of(cls, task: Task, collab: Optional[CollaborationConfig] = None) -> "RunFingerprints":
        layout = [(name, tuple(param.shape), str(param.dtype)) for name, param in task.model.named_parameters()]
        model = hashlib.blake2b(repr(layout).encode(), digest_size=8).hexdigest()
        return cls(model, task.input_fingerprint(), averaging=averaging_settings(collab) if collab else "")


def averaging_settings(collab: CollaborationConfig) -> str:
    """The update rule a trainer announces, in words: the semantics, and for diloco the settings every trainer of
    the run must share."""
    if collab.semantics != Semantics.diloco:
        return collab.semantics.value
    return (
        f"diloco with inner_steps={collab.inner_steps}, outer_lr={collab.outer_lr:g}, "
        f"outer_momentum={collab.outer_momentum:g}"
    )


def averaging_key(run_id: str) -> str:
    return f"{run_id}_averaging"


def publish_averaging_settings(dht: hivemind.DHT, run_id: str, peer_name: str, settings: str, lifetime: float):
    """Announce this trainer's averaging settings (``averaging_settings``), one subkey per peer."""
    return dht.store(
        key=averaging_key(run_id),
        subkey=str(dht.peer_id),
        value={"peer": peer_name, "settings": settings},
        expiration_time=get_dht_time() + lifetime,
        return_future=True,
    )


def require_same_averaging(dht: hivemind.DHT, run_id: str, fingerprints: RunFingerprints) -> None:
    """Refuse to join a run whose trainers form their updates otherwise: a diloco peer with another H or outer
    optimizer, or a diloco peer in a run of gradient-averaging trainers (or the reverse). Trainers of releases
    before diloco announce nothing and are not compared."""
    entry = dht.get(averaging_key(run_id), latest=True)
    theirs = [
        record.value
        for record in (entry.value.values() if entry is not None and isinstance(entry.value, dict) else [])
        if isinstance(record.value, dict) and isinstance(record.value.get("settings"), str)
    ]
    mine = fingerprints.averaging
    for other in theirs:
        # sync, dpu and local peers average gradients or parameters every step and may meet (as before diloco)
        if other["settings"] != mine and "diloco" in other["settings"] + mine:
            raise PeerError(
                f"run {run_id!r} forms its updates otherwise (peer {other.get('peer')} uses {other['settings']}, "
                f"this peer {mine}): use the run's collaboration settings or another collaboration.run_id"
            )


def require_same_model(
    dht: hivemind.DHT, run_id: str, fingerprints: RunFingerprints, input_advice: str = Task.input_mismatch_advice
) -> None:
    """Refuse to join a run whose trainers train a differently shaped model or feed it other inputs (never average
    mismatched state); ``input_advice`` ends the error line of the latter."""
    entry = dht.get(metrics_key(run_id), latest=True)
    records = entry.value.values() if entry is not None and isinstance(entry.value, dict) else []
    for record in records:
        try:
            peer = PeerMetrics.parse_obj(record.value)
        except Exception:  # malformed records are refused by validators; skip anything odd
            continue
        if peer.software_fingerprint and peer.software_fingerprint != fingerprints.software:
            raise PeerError(
                f"run {run_id!r} runs other software (peer {peer.peer_name} has {peer.software_fingerprint}, this "
                f"peer {fingerprints.software}): check out the run's commit and run bash scripts/setup_env.sh"
            )
        if peer.model_fingerprint and peer.model_fingerprint != fingerprints.model:
            raise PeerError(
                f"run {run_id!r} trains a different model (peer {peer.peer_name} has model fingerprint "
                f"{peer.model_fingerprint}, this peer {fingerprints.model}): use the run's task settings "
                f"or another collaboration.run_id"
            )
        if peer.input_fingerprint and fingerprints.inputs and peer.input_fingerprint != fingerprints.inputs:
            raise PeerError(
                f"run {run_id!r} encodes its inputs differently (peer {peer.peer_name} has input fingerprint "
                f"{peer.input_fingerprint}, this peer {fingerprints.inputs}): {input_advice}"
            )
    require_same_averaging(dht, run_id, fingerprints)


def count_trainers(dht: hivemind.DHT, run_id: str) -> int:
    entry = dht.get(metrics_key(run_id), latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return 0
    count = 0
    for record in entry.value.values():
        try:
            if PeerMetrics.parse_obj(record.value).role == "trainer":
                count += 1
        except Exception:  # a malformed record is simply not counted
            continue
    return count
