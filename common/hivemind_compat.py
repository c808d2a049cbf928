"""Every workaround for the pinned hivemind (1.1.12), each with the behaviour it works around.

Upgrading hivemind means re-checking exactly this file: each function names what the pinned release does and
why the project cannot take it as it is. Nothing else in the repository patches or reaches into hivemind.

1. :func:`prefill_optimizer_state` -- hivemind creates missing optimizer state with a virtual zero-gradient step.
2. :func:`skip_nonfinite_steps` -- a partial all-reduce can average to NaN/Inf.
3. :func:`count_state_reloads` -- ``Optimizer.step`` silently reloads state and drops accumulated gradients.
4. :func:`restart_throughput_timer` -- the throughput estimate counts time spent before training started.
5. :func:`client_mode_argument` -- ``Optimizer`` ignores the DHT's client mode unless it is passed explicitly.
6. :func:`silence_schedule_fast_forward_warning` -- a late joiner's schedule fast-forward makes torch warn.
7. :func:`grad_buffers_for_scaler` -- ``hivemind.GradScaler`` unscales the wrong tensors unless gradients
   accumulate in the model's own ``.grad`` buffers.
8. :func:`rsa_private_key_from_der` and :func:`sign_with_identity_key` -- records and tokens are signed with a
   random per-process key unrelated to the peer id.
9. :func:`quiet_requests_from_exited_processes` -- the DHT logs an ERROR with a traceback for a request whose
   sender (an averager being shut down) exited before the DHT read it.
10. :func:`log_groupless_rounds_as_warnings` -- an averaging round that found no partners is logged as an ERROR
    with a traceback, although the optimizer goes on (and says so) and it is routine when peers leave.
"""

from __future__ import annotations

import logging
import traceback
import types
import warnings
from typing import Callable, Sequence

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

PINNED_VERSION = "1.1.12"
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


def count_state_reloads(optimizer: hivemind.Optimizer, on_reload: Callable[[], None]) -> None:
    """Call ``on_reload`` whenever the optimizer replaces this peer's state with the swarm's.

    ``hivemind.Optimizer.step`` reloads state from peers by itself when this peer fell behind, discarding the
    gradients it had accumulated; nothing in its return value says so. The loop must know, or it would credit
    those micro-batches to a step they never reached.
    """
    reload_state = optimizer.load_state_from_peers

    def counted_reload(**kwargs):
        on_reload()
        return reload_state(**kwargs)

    optimizer.load_state_from_peers = counted_reload


def restart_throughput_timer(optimizer: hivemind.Optimizer) -> None:
    """Start the peer's throughput estimate now, not when the optimizer was built.

    hivemind times the first micro-batch from the optimizer's creation, so a wait before training (a start
    barrier, a state download) counts as training time: a peer that waited 10 s reports ~1.5 samples/s, its
    progress tracker expects the step to take minutes and refreshes only every 10 s, and a short first step can
    end before it has seen the other peers -- it then steps alone on local gradients.
    """
    optimizer.tracker.performance_ema.reset_timer()


def client_mode_argument(dht: hivemind.DHT) -> bool:
    """The ``client_mode`` to pass to ``hivemind.Optimizer`` explicitly.

    hivemind 1.1.12 inverts its ``None`` check and takes ``dht.client_mode`` only for a non-None value; left at
    its default, a client-mode trainer crashes at its first epoch (state sharing on a client averager).
    """
    return dht.client_mode


def silence_schedule_fast_forward_warning() -> None:
    """A late joiner's downloaded state fast-forwards its LR schedule to the swarm's step: hivemind steps the
    scheduler without an optimizer step, which is intended, but torch warns as if the call order were wrong."""
    warnings.filterwarnings(
        "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
    )


def rsa_private_key_from_der(der: bytes) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` can only generate a fresh key; its pickling state is the DER encoding, so
    restoring that state is how an existing key (a peer identity file) becomes one."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def sign_with_identity_key(private_key: RSAPrivateKey) -> None:
    """Make ``private_key`` the process-wide key hivemind signs with.

    ``RSASignatureValidator`` (metrics and progress records), the progress tracker and access-token authorizers
    all default to ``RSAPrivateKey.process_wide()``, a key generated at random in each process and unrelated to
    the libp2p identity. Installing the identity key there (before any of them is built) makes a peer's records
    and tokens name its peer id, so the monitor can key contributions by peer id and a restarted peer keeps it.
    """
    with RSAPrivateKey._process_wide_key_lock:
        current = RSAPrivateKey._process_wide_key
        if current is not None and current is not private_key and current.to_bytes() != private_key.to_bytes():
            raise RuntimeError("hivemind's process-wide key was already used before the peer identity was loaded")
        RSAPrivateKey._process_wide_key = private_key


def grad_buffers_for_scaler(uses_grad_scaler: bool, use_local_updates: bool) -> bool:
    """The ``reuse_grad_buffers`` to give ``hivemind.Optimizer``: True whenever a ``hivemind.GradScaler`` is used
    with gradient averaging.

    Before averaging, hivemind unscales the gradients it finds in the model's ``.grad`` buffers. With its default
    separate accumulators those buffers hold only the last micro-batch: the accumulated gradients would be averaged
    and applied still multiplied by the loss scale (2^16), and the finiteness check would look at one micro-batch.
    With ``reuse_grad_buffers`` the ``.grad`` buffers are the accumulators, so unscaling and the check cover the
    whole step. hivemind forbids it with local updates, which unscale every micro-batch anyway.
    """
    return uses_grad_scaler and not use_local_updates


class _RequestFromExitedProcess(logging.Filter):
    """Rewrites the one record described in :func:`quiet_requests_from_exited_processes` as an INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.funcName == "_run" and isinstance(error, (FileNotFoundError, ConnectionError)):
            frames = traceback.extract_tb(record.exc_info[2])
            if any(frame.filename.endswith("multiprocessing/resource_sharer.py") for frame in frames):
                record.msg, record.args = "dropped a DHT request from a process that has already exited", ()
                record.exc_info, record.exc_text = None, None
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_requests_from_exited_processes() -> None:
    """Log hivemind's "request from an exited process" as the harmless INFO line it is, not as an ERROR.

    Every hivemind process talks to the DHT process through one pipe; a request carries a future whose reply pipe is
    pickled as a handle that the DHT process fetches from the *sender's* ``multiprocessing`` resource sharer when it
    reads the request. An averager being shut down can exit between sending a request and the DHT reading it: the
    fetch then fails (``FileNotFoundError``, or a refused or reset connection, in ``resource_sharer``), and
    ``DHT.run`` logs an ERROR with a traceback. Nobody waits for that reply any more, so nothing is lost; the DHT
    goes on serving. Only that exact record is rewritten: any other error from ``DHT.run`` keeps its level. Called
    before the DHT process is forked, so the filter is inherited by it.
    """
    dht_logger = logging.getLogger("hivemind.dht.dht")
    if not any(isinstance(existing, _RequestFromExitedProcess) for existing in dht_logger.filters):
        dht_logger.addFilter(_RequestFromExitedProcess())


GROUPLESS_ROUND = "Averaging step failed: could not find a group"


class _GrouplessRound(logging.Filter):
    """Rewrites the record described in :func:`log_groupless_rounds_as_warnings` as a one-line WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            record.funcName == "_step"
            and type(error).__name__ == "AllreduceException"
            and str(error) == GROUPLESS_ROUND
        ):
            record.msg, record.args = "averaging round ended without partners (no group formed in time)", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_groupless_rounds_as_warnings() -> None:
    """Log "could not find a group" as one WARNING line instead of an ERROR with a traceback.

    ``DecentralizedAverager._step`` logs every round that formed no group with ``logger.exception``. Nothing failed
    inside this peer: the partners did not come in time -- always so for the last round when the whole swarm stops,
    and for a round in progress when a peer is stopped by a signal. ``hivemind.Optimizer`` reports the outcome
    itself ("Averaging gradients failed ... Proceeding with local gradients", "Averaging failed with ..."), and the
    trainer warns when a step used local gradients only, so the record stays visible as a WARNING; any other
    averaging error keeps its level and traceback.
    """
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(existing, _GrouplessRound) for existing in averager_logger.filters):
        averager_logger.addFilter(_GrouplessRound())
