"""Every workaround for the pinned hivemind (1.1.12), each with the behaviour it works around.

Upgrading hivemind means re-checking exactly this file: each function names what the pinned release does and
why the project cannot take it as it is. Nothing else in the core patches hivemind (the averaging benchmark's
diagnostics in common/tools/allreduce.py log its internals, in the benchmark's own processes only).

The numbers are stable names that notes refer to; 1, the optimizer-state prefill, is now
:func:`common.optimizer.prefill_optimizer_state` (it no longer patches hivemind).

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
11. :func:`bound_state_downloads` -- ``Optimizer.load_state_from_peers`` retries a failed download forever, logging a
    traceback each time.
12. :func:`log_unreachable_state_sources_as_info` -- a state download from one peer that cannot be reached (e.g.
    "routing: not found" for a peer that joined seconds ago) is logged as an ERROR with a traceback, although the
    averager goes on to the next peer and the caller reports the outcome.
13. :func:`stream_results_to_zero_share_full_peers` -- a full peer that the load balancer gives no share of the
    all-reduce gets its averaged parts only after it has sent its whole vector, which cancels the balancing gain.
14. :func:`read_8bit_tensors_with_numpy_2` -- with numpy >= 2, hivemind cannot read an 8-bit quantized tensor back,
    so averaging with ``uniform8bit`` / ``blockwise8bit`` compression silently leaves peers with partial averages.
15. :func:`log_ended_averagers_as_warnings` -- shutting down an averager whose process already ended (a SIGTERM
    to the peer's whole process group ends it too) is logged as an ERROR with an empty traceback.
16. :func:`keep_inbound_stream_handlers_alive` -- the garbage collector can destroy the task serving a peer's
    inbound stream mid-transfer, losing what the stream carried.
17. :func:`close_averager_p2p_on_shutdown` -- an averager process exits without closing its connection to the p2p
    daemon, leaving that connection's Unix socket file in /tmp for every averager of every run.
18. :func:`finish_abandoned_executor_maps` -- when an all-reduce stream is dropped mid-transfer, the garbage
    collector destroys the task feeding it, which asyncio logs as an ERROR ("Task was destroyed but it is pending!").
19. :func:`catch_up_one_step_behind` -- a trainer that is one step behind the swarm right after its own update
    downloads the whole state and drops its accumulated gradients, where stepping would catch it up (opt-in).
20. :func:`deliver_whole_streams` -- a p2p stream handler closes right after its last response, and the daemons'
    reset on that close can drop the responses the caller has not read yet (the tail of an all-reduce part).
21. :func:`gradient_rounds_start_at_the_update` -- with delayed gradient averaging, the next round forms its group
    while the previous one still runs, and the previous round's end makes the averager turn the new group's early
    parts away, so most rounds average only part of the gradient over the whole group.
22. :func:`verify_state_downloads` -- a state download carries no checksum, so a receiver loads whatever it
    assembled; each donor now sends per-tensor digests and each receiver checks them before use.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
import types
import warnings
from typing import Callable

import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.crypto import RSAPrivateKey

from common.errors import PeerError

PINNED_VERSION = "1.1.12"  # the hivemind release every patch here is written against
# Raise it whenever a patch changes what peers send each other or how they treat each other's messages: peers of
# one run must run the same patch set over the same hivemind (``software_fingerprint``, checked by
# ``common.backends.require_same_model``).
PATCH_SET_VERSION = "2026.12.2"


def require_pinned_hivemind() -> None:
    """Refuse to run these patches over another hivemind release: they replace its private internals."""
    if hivemind.__version__ != PINNED_VERSION:
        raise PeerError(
            f"hivemind {hivemind.__version__} is installed, but common/hivemind_compat.py patches hivemind "
            f"{PINNED_VERSION}: run bash scripts/setup_env.sh (requirements.txt pins it)"
        )


def software_fingerprint() -> str:
    """What a peer must share with the run besides the model: the hivemind release and our patch set over it."""
    return f"hivemind {hivemind.__version__} + patch set {PATCH_SET_VERSION}"


logger = logging.getLogger(__name__)


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
            if any(
                frame.filename.endswith("multiprocessing/resource_sharer.py") or frame.name == DETACH_FROM_SENDER
                for frame in frames
            ):
                record.msg, record.args = "dropped a DHT request from a process that has already exited", ()
                record.exc_info, record.exc_text = None, None
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_requests_from_exited_processes() -> None:
    """Log hivemind's "request from an exited process" as the harmless INFO line it is, not as an ERROR.

    Every hivemind process talks to the DHT process through one pipe; a request carries a future whose reply pipe is
    pickled as a handle that the DHT process fetches from the *sender's* ``multiprocessing`` resource sharer when it
    reads the request. An averager being shut down can exit between sending a request and the DHT reading it: the
    fetch then fails in ``resource_sharer`` (``FileNotFoundError``, a refused or reset connection, ``EOFError``),
    and ``DHT.run`` logs an ERROR with a traceback. Nobody waits for that reply any more, so nothing is lost; the DHT
    goes on serving. Only that exact record is rewritten: any other error from ``DHT.run`` keeps its level. Called
    before the DHT process is forked, so the filter is inherited by it.
    """
    dht_logger = logging.getLogger("hivemind.dht.dht")
    if not any(isinstance(existing, _RequestFromExitedProcess) for existing in dht_logger.filters):
        dht_logger.addFilter(_RequestFromExitedProcess())
    # the fetch can also end in EOFError (the sender's sharer thread went away mid-handoff), which ``DHT.run`` does
    # not catch: its process would die with a traceback during shutdown. Reported as the connection error it is.
    from multiprocessing import resource_sharer

    duplicated_fd = getattr(resource_sharer, "DupFd", None)
    if duplicated_fd is None or duplicated_fd.detach.__name__ == DETACH_FROM_SENDER:
        return
    detach = duplicated_fd.detach

    def detach_from_sender(self):
        try:
            return detach(self)
        except EOFError as error:
            raise ConnectionResetError("the process that sent this handle has exited") from error

    duplicated_fd.detach = detach_from_sender


DETACH_FROM_SENDER = "detach_from_sender"  # the wrapper's name: the filter knows its frames by it


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


STATE_RETRY_MAX_SECONDS = 16.0  # longest wait between two attempts to download the swarm's state
STOP_POLL_SECONDS = 0.25  # how often a wait between attempts checks whether the peer was asked to stop
# hivemind keeps a peer's progress record this long after its last report (ProgressTracker's metadata_expiration).
# When downloads have served nothing as new as the swarm's step for this long, the records still claiming that step
# belong to peers that do not hold its state: auxiliary peers follow the global step but share no state.
HOLDERS_GONE_AFTER_SECONDS = 60.0


def bound_state_downloads(
    optimizer: hivemind.Optimizer, deadline: float, stop_requested: Callable[[], bool] = lambda: False
) -> None:
    """Make ``optimizer.load_state_from_peers`` give up after ``deadline`` seconds with one line (``PeerError``).

    hivemind's method retries a download that raised (a timeout, a broken peer) at once and forever, logging a
    traceback each time; ``Optimizer.step`` calls it by itself whenever this peer fell behind, so a peer that can
    never get the swarm's state spins silently. The replacement does what hivemind's does around the download --
    join a running gradient round with zero weight, finish delayed updates, pause the progress tracker, take the
    swarm's step if one behind, report progress, share state at its new step, drop accumulated gradients -- but
    retries with backoff (1, 2, 4 ... s, at most ``STATE_RETRY_MAX_SECONDS``) logging one WARNING line per failed
    attempt, and raises ``PeerError`` once ``deadline`` seconds have passed. Besides an exception, an attempt
    failed when nothing newer was loaded although the swarm is more than one step ahead: hivemind would return,
    and ``step`` would call it again at the next micro-batch. When such attempts go on for
    ``HOLDERS_GONE_AFTER_SECONDS`` (every peer holding the swarm's state crashed, and an auxiliary peer keeps
    announcing its step), the peer takes the swarm's step with the newest state served -- the monitor's last
    checkpoint when there is one -- so the run goes on instead of waiting for a state nobody has. A stop request
    ends the waiting early (the caller's loop then sees the stop). Installed as an instance attribute, so
    ``Optimizer.step`` calls it too.
    """

    def load_state_from_peers(**kwargs) -> None:
        _load_state_within_deadline(optimizer, deadline, stop_requested, kwargs)

    optimizer.load_state_from_peers = load_state_from_peers


def _load_state_within_deadline(
    optimizer: hivemind.Optimizer, deadline: float, stop_requested: Callable[[], bool], kwargs: dict
) -> None:
    # tag along with a gradient round already under way: cancelling it would restart everyone's matchmaking
    if optimizer.scheduled_grads is not None and not optimizer.scheduled_grads.done():
        optimizer._tag_along_with_zero_weight(optimizer.scheduled_grads)
        optimizer.scheduled_grads = None
    optimizer.state_averager.step(wait_for_delayed_updates=True)

    with optimizer.tracker.pause_updates():
        _download_state(optimizer, deadline, stop_requested, kwargs)
        swarm_epoch = optimizer.tracker.global_epoch
        if swarm_epoch - 1 <= optimizer.local_epoch < swarm_epoch:
            logger.info(f"catching up with the swarm's global step {swarm_epoch}")
            optimizer.state_averager.local_epoch = swarm_epoch
        optimizer.tracker.report_local_progress(local_epoch=optimizer.local_epoch, samples_accumulated=0)
        if not optimizer.client_mode:
            optimizer.state_averager.state_sharing_priority = optimizer.local_epoch
        if optimizer.use_gradient_averaging:
            optimizer.grad_averager.reset_accumulated_grads_()
            if not optimizer.client_mode:
                optimizer.grad_averager.state_sharing_priority = optimizer.local_epoch


def _download_state(
    optimizer: hivemind.Optimizer, deadline: float, stop_requested: Callable[[], bool], kwargs: dict
) -> None:
    """Attempts until one succeeds; each gets at most ``load_state_timeout`` and never runs past ``deadline``."""
    started = time.monotonic()
    give_up_at = started + deadline
    attempt, behind_since = 0, None
    while True:
        attempt += 1
        epoch_before = optimizer.local_epoch
        try:
            optimizer.state_averager.load_state_from_peers(timeout=_attempt_timeout(optimizer, give_up_at), **kwargs)
            if optimizer.grad_averager is not None:
                optimizer.grad_averager.load_state_from_peers(
                    timeout=_attempt_timeout(optimizer, give_up_at), **kwargs
                )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # what hivemind retries on, a timeout included
            failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        else:
            swarm_epoch = optimizer.tracker.global_epoch
            if optimizer.local_epoch > epoch_before or optimizer.local_epoch >= swarm_epoch - 1:
                return
            behind_since = time.monotonic() if behind_since is None else behind_since
            if time.monotonic() - behind_since >= HOLDERS_GONE_AFTER_SECONDS:
                logger.warning(
                    f"no peer has served the swarm's state of global step {swarm_epoch} for "
                    f"{HOLDERS_GONE_AFTER_SECONDS:.0f} s: the peers that held it left; continuing at global step "
                    f"{swarm_epoch} from the newest state served (global step {optimizer.local_epoch})"
                )
                optimizer.state_averager.local_epoch = swarm_epoch
                return
            failure = (
                f"no peer served a state newer than global step {optimizer.local_epoch} "
                f"(the swarm is at global step {swarm_epoch})"
            )
        elapsed = time.monotonic() - started
        if elapsed >= deadline:
            raise PeerError(
                f"could not download the swarm's state from any peer within {deadline:g} s ({attempt} attempts in "
                f"{elapsed:.1f} s; last: {failure}): check that the initial peers are right and that peers of this "
                f"run are up, or raise collaboration.load_state_deadline"
            )
        delay = min(STATE_RETRY_MAX_SECONDS, 2.0 ** (attempt - 1), give_up_at - time.monotonic())
        logger.warning(
            f"state download attempt {attempt} failed after {elapsed:.1f} s ({failure}); retrying in {delay:.0f} s "
            f"(giving up {deadline:g} s after the first attempt)"
        )
        waited_until = time.monotonic() + max(delay, 0.0)
        while time.monotonic() < waited_until:
            if stop_requested():
                logger.info("stop requested: no further state download attempts")
                return
            time.sleep(min(STOP_POLL_SECONDS, max(waited_until - time.monotonic(), 0.0)))


def _attempt_timeout(optimizer: hivemind.Optimizer, give_up_at: float) -> float:
    """``load_state_timeout``, cut short so that no attempt runs past the deadline (the averager's own download then
    finishes in the background and is dropped)."""
    return min(optimizer.load_state_timeout, max(give_up_at - time.monotonic(), 0.1))


STATE_DOWNLOAD_FAILED = "Failed to download state from "


class _UnreachableStateSource(logging.Filter):
    """Rewrites the record described in :func:`log_unreachable_state_sources_as_info` as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if (
            record.funcName == "_load_state_from_peers"
            and message.startswith(STATE_DOWNLOAD_FAILED)
            and isinstance(error, (ControlFailure, TimeoutError))
        ):
            peer = message[len(STATE_DOWNLOAD_FAILED) :].split(" ", 1)[0]
            reason = str(error) or "no data within the request timeout"
            record.msg, record.args = f"could not download state from peer {peer} ({reason}); asking the next peer", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def log_unreachable_state_sources_as_info() -> None:
    """Log a state download from a peer that could not be reached, or sent nothing in time, as one INFO line.

    ``DecentralizedAverager._load_state_from_peers`` asks the peers that share state one after another and logs each
    one that fails with ``logger.exception``. When the p2p daemon cannot open a stream to that peer
    (``ControlFailure``: "routing: not found" for a peer whose address this daemon does not know yet -- routine in
    the first seconds of a fresh swarm --, "dial backoff" or "protocols not supported" for one that left) or the
    peer sends nothing in time (``TimeoutError``), nothing is wrong in this peer: the averager goes on to the next
    peer, and the caller reports the outcome at WARNING when it matters (:func:`bound_state_downloads` when no peer
    served the state it needed, the monitor when it got no newer state to checkpoint). Any other download error (a
    corrupt or mismatched state, say) keeps its level and traceback. Installed before the averagers are forked, so
    their processes inherit it.
    """
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(existing, _UnreachableStateSource) for existing in averager_logger.filters):
        averager_logger.addFilter(_UnreachableStateSource())


def stream_results_to_zero_share_full_peers() -> None:
    """Let a full peer that reduces nothing receive averaged parts while it is still sending, as every peer does.

    hivemind 1.1.12 holds back the results for any peer whose share of the all-reduce is 0 until that peer has
    sent its whole vector (``AllReduceRunner.should_delay_results``: meant for client-mode peers), and the
    averager never tells the runner which peers are in client mode: the runner infers "client" from a share of 0
    too. The load balancer, though, gives a share of 0 to *slow full peers* -- and its cost model assumes their
    upload and download overlap (vector size / bandwidth). Held back, such a peer uploads, then downloads:
    2 x vector / bandwidth, more than the 1.5 x of an equal split, so balancing gained nothing (measured on
    emulated links: 1 x 500 + 3 x 50 Mb/s, 5 M parameters: balanced 3.4 s, equal split 3.3 s; with this change
    2.1 s). Here the runner gets the modes the peers declared and holds back results by mode, so client-mode
    peers still wait and slow full peers overlap both directions. Patched on the classes, before any averager
    process is forked (they inherit it); calling it again does nothing.
    """
    from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
    from hivemind.averaging.averager import DecentralizedAverager

    if getattr(DecentralizedAverager, "_declares_modes_to_runner", False):
        return
    run_allreduce = DecentralizedAverager._run_allreduce_inplace_

    async def with_declared_modes(self, tensors, group_info, group_id=None, **kwargs):
        if "modes" not in kwargs:  # each peer's gathered metadata is (bandwidth, mode, user data)
            declared = [self.serializer.loads(metadata)[1] for metadata in group_info.gathered]
            kwargs["modes"] = tuple(map(AveragingMode, declared))
        return await run_allreduce(self, tensors, group_info, group_id, **kwargs)

    def holds_back_client_mode_peers(self, peer_id) -> bool:
        return self.modes[self.ordered_peer_ids.index(peer_id)] == AveragingMode.CLIENT

    DecentralizedAverager._run_allreduce_inplace_ = with_declared_modes
    DecentralizedAverager._declares_modes_to_runner = True
    AllReduceRunner.should_delay_results = holds_back_client_mode_peers


def _header_int(buffer: bytes, offset: int = 0) -> int:
    return int(np.frombuffer(buffer, offset=offset, count=1, dtype=np.int64)[0])


def read_8bit_tensors_with_numpy_2() -> None:
    """Read 8-bit quantized tensors back under numpy 2, exactly as hivemind writes them.

    hivemind 1.1.12 parses the codebook size in front of a quantized tensor with ``int(np.frombuffer(..., count=1))``:
    converting a 1-element array to ``int`` is an error in numpy 2. Every reducer then fails to read every part
    sent to it, bans the sender ("Reducer: received 25.0% of input tensors"), and the peers end the round with
    partial averages (relative error 0.6 on emulated links) or time out. Same layout and arithmetic, header read
    with an index; the transport, the quantizers and the wire format are hivemind's.
    """
    from hivemind.compression.quantization import (
        _BLOCKWISE_QUANTIZATION_BLOCKSIZE,
        BlockwiseQuantization,
        Quantization,
    )

    def extract(self, serialized_tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook = np.frombuffer(buffer, offset=8, count=_header_int(buffer), dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    def extract_blockwise(self, serialized_tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise  # hivemind's own requirement for this codec

        buffer = serialized_tensor.buffer
        absmax = np.frombuffer(buffer, offset=16, count=_header_int(buffer), dtype=self.codebook_dtype)
        codebook_offset = 16 + absmax.nbytes
        codebook = np.frombuffer(
            buffer, offset=codebook_offset, count=_header_int(buffer, 8), dtype=self.codebook_dtype
        )
        quantized = np.frombuffer(buffer, offset=codebook_offset + codebook.nbytes, dtype=self.indices_dtype)
        result = dequantize_blockwise(
            torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)),
            absmax=torch.as_tensor(absmax),
            code=torch.as_tensor(codebook),
            blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE,
            nested=False,
        )
        return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)

    Quantization.extract = extract
    BlockwiseQuantization.extract = extract_blockwise


ENDED_AVERAGER = "Averager shutdown has no effect: the process is already not alive"


class _EndedAverager(logging.Filter):
    """Rewrites the record described in :func:`log_ended_averagers_as_warnings` as a one-line WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName == "shutdown" and record.getMessage() == ENDED_AVERAGER:
            record.msg, record.args = "an averager process had already ended when the peer shut it down", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_ended_averagers_as_warnings() -> None:
    """Log "averager shutdown has no effect" as one WARNING line instead of an ERROR with an empty traceback.

    ``DecentralizedAverager.shutdown`` calls ``logger.exception`` when the averager's process is no longer alive.
    A SIGTERM to a peer's whole process group (``kill -TERM -- -PGID``, a service manager) reaches its forked
    averager processes too, and they end at once (``common.lifecycle.StopFlag`` lets forked children die of
    SIGTERM), so ``hivemind.Optimizer.shutdown`` finds them gone: nothing is left to stop. The line stays visible
    as a WARNING because an averager process that died on its own is worth knowing about.
    """
    averager_logger = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(existing, _EndedAverager) for existing in averager_logger.filters):
        averager_logger.addFilter(_EndedAverager())


def keep_inbound_stream_handlers_alive() -> None:
    """Hold a strong reference to every task that serves an inbound p2p stream until it ends.

    The p2p daemon hands each inbound stream (an all-reduce part, a state download) to the process's
    ``ControlClient`` over a Unix socket; asyncio runs ``ControlClient._handler`` for it as a task. The event loop
    keeps only weak references to tasks, and while the handler waits with the socket's reading paused (flow
    control), nothing outside a reference cycle holds the task, its stream or the future it waits on. A garbage
    collection then destroys the task mid-transfer ("Task was destroyed but it is pending!", then "Unhandled
    exception in client_connected_cb ... cannot reuse already awaited coroutine"), and whatever the stream carried
    (an all-reduce part, a state download) is lost to the peer at the other end, which sees its stream reset.
    Measured on 3 local trainers under ``dpu`` (averaging beside computation, so streams overlap): 17-23 destroyed
    handlers per trainer in 250 steps; none in 130 steps with this patch.
    Patched on the class before the DHT and averager processes are forked (they inherit it); calling it again
    does nothing.
    """
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    if getattr(ControlClient, "_keeps_stream_handlers_alive", False):
        return
    serve_stream = ControlClient._handler

    async def serve_stream_kept_alive(self, reader, writer):
        running = self.__dict__.setdefault("_running_stream_handlers", set())
        task = asyncio.current_task()
        running.add(task)
        try:
            await serve_stream(self, reader, writer)
        finally:
            running.discard(task)

    ControlClient._handler = serve_stream_kept_alive
    ControlClient._keeps_stream_handlers_alive = True


def close_averager_p2p_on_shutdown() -> None:
    """Close an averager process's own p2p client when the averager shuts down.

    Each ``DecentralizedAverager`` process (a trainer has two: gradients and state) talks to the peer's p2p daemon
    through a replica of the DHT's ``P2P``, which listens on a Unix socket ``/tmp/hivemind-p2pclient-<id>.sock``.
    ``DecentralizedAverager._shutdown`` removes the averager's handlers but never shuts the replica down, and the
    process then ends without running finalizers, so the socket file stays behind: 12 files after one swarm of
    3 trainers, an auxiliary peer and a monitor; 1 and 5 in two runs with this patch (left by a peer that stopped
    without shutting its averagers down, and by a DHT process hivemind terminated after its shutdown grace
    period). The replica has no daemon of its own (``P2P.shutdown`` only closes its client and removes its socket
    file), so closing it after the averager's own shutdown touches nothing the DHT process still uses. Patched on
    the class before the averager processes are forked; calling it again does nothing.
    """
    from hivemind.averaging.averager import DecentralizedAverager

    if getattr(DecentralizedAverager, "_closes_p2p_on_shutdown", False):
        return
    shutdown = DecentralizedAverager._shutdown

    async def shutdown_and_close_p2p(self, timeout):
        try:
            await shutdown(self, timeout)
        finally:
            replica = getattr(self, "_p2p", None)
            if replica is not None:
                await replica.shutdown()

    DecentralizedAverager._shutdown = shutdown_and_close_p2p
    DecentralizedAverager._closes_p2p_on_shutdown = True


def finish_abandoned_executor_maps() -> None:
    """Keep the task that feeds an all-reduce's executor map alive until the map is closed.

    hivemind's all-reduce serializes and deserializes tensor parts through ``amap_in_executor``, an async generator
    that starts a producer task filling a one-item queue and cancels it in its ``finally``. When a stream is
    dropped mid-transfer (a groupmate timed out, a round was abandoned), the generator, its producer (blocked on the
    full queue) and the queue are left referring only to each other. The garbage collector then finalizes the whole
    cycle at once: the generator's finalizer schedules its ``aclose`` (which would cancel the producer), but the
    producer task is finalized in the same pass while still pending, and asyncio logs "Task was destroyed but it is
    pending!" as an ERROR: 39-51 times per trainer in a 500-step ``dpu`` run of 3 trainers, beside 5-8 "Future
    exception was never retrieved" ERRORs for failures the producer queued and no one read; none of either came
    from a producer in such a run with this patch. The replacement does what hivemind's does but keeps each
    producer in a set until it is done, so only the generator is collected; its ``aclose`` then cancels the
    producer and retrieves whatever it queued, also while being cancelled. Installed into the two hivemind modules
    that use it, before the averager processes are forked; calling it again does nothing.
    """
    from hivemind.averaging import allreduce, partition
    from hivemind.utils.asyncio import azip

    if getattr(partition, "_finishes_abandoned_executor_maps", False):
        return
    running_producers = set()

    async def amap_in_executor(func, *iterables, max_prefetch: int = 1, executor=None):
        loop = asyncio.get_running_loop()
        results = asyncio.Queue(max_prefetch)

        async def produce():
            try:
                async for args in azip(*iterables):
                    await results.put(loop.run_in_executor(executor, func, *args))
                await results.put(None)
            except Exception as error:
                failed = loop.create_future()
                failed.set_exception(error)
                await results.put(failed)

        producer = asyncio.create_task(produce())
        running_producers.add(producer)
        producer.add_done_callback(running_producers.discard)
        try:
            result = await results.get()
            while result is not None:
                yield await result
                result = await results.get()
        finally:
            producer.cancel()
            # a stream read that breaks as it is cancelled raises the stream's error instead, which the producer
            # queues as it ends: drain until it has ended, retrieving every queued failure
            while not (producer.done() and results.empty()):
                queued = [results.get_nowait() for _ in range(results.qsize())]
                unfinished = [producer, *(item for item in queued if item is not None)]
                for awaitable in unfinished:
                    awaitable.cancel()
                await asyncio.gather(*unfinished, return_exceptions=True)

    partition.amap_in_executor = allreduce.amap_in_executor = amap_in_executor
    partition._finishes_abandoned_executor_maps = True


def catch_up_one_step_behind(optimizer: hivemind.Optimizer) -> None:
    """Let a trainer one global step behind right after its own update catch up by stepping, not by reloading.

    Once per step, right after its update, ``hivemind.Optimizer`` requires a trainer's epoch to equal the swarm's
    exactly; one step behind, it logs "Peer is out of sync", downloads the swarm's state and drops the gradients it
    has accumulated. At any other time it tolerates one step behind: the trainer is ready at once, finishes its step
    and is level again (hivemind's rule for a peer that just missed a transition). A trainer whose update ran a
    second or two past a swarm-mate's is routinely one step behind at that check: in 500-step ``dpu`` runs of three
    trainers each reloaded 11-27 times and only 346-392 gradient rounds had all three. This applies the tolerant
    rule at that check too; two or more steps behind still reloads. With it, over three seeds: 0-2 reloads, 480-495
    rounds with all three trainers, held-out MLM loss +0.48 % from one process's on average instead of +0.84 %
    (paper_results/comparison/past_plateau, tenth measurement; ``sync``: twelfth). Opt-in through
    ``collaboration.catch_up_one_step_behind``.
    """

    def should_load_state_from_peers(self: hivemind.Optimizer) -> bool:
        # spend the exact check where hivemind would, so that its tolerant rule decides
        if self._should_check_synchronization_on_update and self.tracker.fetched_global_progress_this_epoch.is_set():
            self._should_check_synchronization_on_update = False
        return hivemind.Optimizer._should_load_state_from_peers(self)

    optimizer._should_load_state_from_peers = types.MethodType(should_load_state_from_peers, optimizer)


def gradient_rounds_start_at_the_update(optimizer: hivemind.Optimizer) -> None:
    """With delayed gradient averaging, start each gradient round at the trainer's update, never before it.

    A groupmate can send its part of a round before this peer has started that round (the group is formed, this
    peer's trigger has not come). hivemind's averager then holds the part on one event,
    ``_pending_groups_registered``, shared by all its rounds: each round clears it when it starts looking for a
    group and sets it when it registers its group *or ends*. With ``delay_grad_averaging`` (``dpu``) a trainer
    pre-schedules the next round while the previous one still runs in the background; when that one ends, the event
    is set, and every early part of the new group is answered BAD_GROUP_ID. The sender and this peer each lose the
    other's share of that part ("Reducer: received N % of input tensors", "Averaging: received N % results") and
    apply their own gradient for it: with three ``dpu`` trainers about one such round per trainer and step.

    Holding the next round back only while the previous one runs is not enough: whether a trainer then
    pre-schedules depends on how long its previous round took, so some trainers pre-schedule and others start at
    the update, and pre-scheduled pairs form groups without the third. Here no trainer pre-schedules: ``dpu``'s
    update first waits for the previous delayed update (so the previous round has ended), then starts a round, and
    every trainer does the same within a fraction of a second of the others, well inside the matchmaking time.
    The cost: matchmaking (at least ``matchmaking_time``) no longer overlaps the last micro-batches, so where a step
    computes for little more than that, the next update waits for the round. With three trainers of the tiny
    recipe (2-3 s steps, 2-s matchmaking) partial rounds fell from 464-629 to 8-28 per trainer in 500 steps, and
    throughput from 87-94 to 81-88 samples/s (paper_results/comparison/past_plateau, seventeenth measurement); a
    full-scale step takes minutes.

    Without this, hivemind also starts no round at all when the only control it holds at an update is the previous
    step's (or one that failed): it applies the trainer's own gradients as if they were the swarm's average, logging
    "Not using pre-scheduled group for state averaging". Here that control is dropped and a round starts.
    """

    def maybe_schedule_gradient_averaging(self: hivemind.Optimizer) -> None:
        """Pre-schedule nothing: the round starts at the update."""

    def begin_averaging_gradients(self: hivemind.Optimizer, grad_scaler) -> bool:
        scheduled = self.scheduled_grads
        if scheduled is not None and (scheduled.triggered or scheduled.done()):
            self.scheduled_grads = None  # the previous step's round, or a failed one: this step gets its own
        return hivemind.Optimizer._begin_averaging_gradients(self, grad_scaler)

    optimizer._maybe_schedule_gradient_averaging = types.MethodType(maybe_schedule_gradient_averaging, optimizer)
    optimizer._begin_averaging_gradients = types.MethodType(begin_averaging_gradients, optimizer)


STREAM_LINGER_SECONDS = 30.0


class StreamCutShort(P2PHandlerError):
    """A p2p stream that ended without its end marker (:func:`deliver_whole_streams`): what arrived is incomplete.
    A ``P2PHandlerError``, so that hivemind's matchmaking and all-reduce treat it as a failed peer."""


def deliver_whole_streams() -> None:
    """End every p2p stream with an end marker, and close a served stream only once its caller has read it all.

    A stream handler's responses reach the caller through both peers' p2p daemons. When the handler's process
    closes its connection, the serving daemon closes the libp2p stream, which also fails the daemon's own pending
    read of the caller's (already finished) requests; the daemon then resets the stream, and a reset makes the
    caller's daemon drop whatever it has received but not yet passed on to the caller. hivemind 1.1.12 closes as
    soon as the last response is written, so a caller that reads a little late -- a busy averager process -- loses
    the tail of the stream: "peer ... sent 22 parts, but we expected 25", and the all-reduce keeps local values for
    those parts ("Averaging: received 76.2% results"). Measured with 3 ``sync`` trainers of the tiny ALBERT: 5 lost
    tails in 120 steps (the handler had sent every part each time), none in 200 steps with this patch; it also
    made the 2-trainer ``sync`` equivalence test fail once in a CI run and once in 20 runs beside two busy loops.
    Here the handler sends hivemind's own end-of-stream marker after its last response and then waits (at most
    ``STREAM_LINGER_SECONDS``) for the caller to close; a caller stops at the marker and closes at once. Both sides
    must run this patch (every peer of this project does, via ``common.dht.start_dht``): a caller without it would
    take the marker for an error. A stream that ends without the marker was cut short (the serving process died or
    its connection broke) and raises :class:`StreamCutShort`: hivemind reads such an end as a complete stream, so a
    state download from a donor killed mid-transfer assembled its last tensor from the parts that had arrived
    (``shape '[4000, 64]' is invalid for input of size 131072``: 8 of its 16 64-KiB parts), or silently lacked the
    tensors after it (issue 46; ``scripts/experiments/state_download_faults.py``). Errors are sent with a non-empty
    message so that none reads as the marker. It also installs :func:`verify_state_downloads`, the other half of
    this project's wire protocol, so that a peer speaking one speaks both. Patched on ``P2P`` before the DHT and
    averager processes are forked (they inherit it); calling it again does nothing.
    """
    from contextlib import closing, suppress

    from hivemind.p2p.p2p_daemon import P2P, P2PContext
    from hivemind.proto.p2pd_pb2 import RPCError

    verify_state_downloads()
    if getattr(P2P, "_delivers_whole_streams", False):
        return

    async def wait_until_closed(reader, pending_read):
        with suppress(Exception):  # closing may also break the connection
            await pending_read
            while await reader.read(2**16):
                pass  # requests the finished handler did not read

    async def add_protobuf_stream_handler(self, name, handler, input_protobuf_type, max_prefetch=5, balanced=False):
        async def handle_stream(stream_info, reader, writer):
            context = P2PContext(handle_name=name, local_id=self.peer_id, remote_id=stream_info.peer_id)
            requests = asyncio.Queue(max_prefetch)

            async def read_requests():
                while (request := await requests.get()) is not None:
                    yield request

            async def send(response) -> bool:
                try:
                    await P2P.send_protobuf(response, writer)
                    return True
                except Exception:
                    return False  # the caller has closed (a matchmaking follower, once it knows its group)

            async def process_requests():
                try:
                    async for response in handler(read_requests(), context):
                        if not await send(response):
                            return
                    await send(P2P.END_OF_STREAM)
                except Exception as error:
                    logger.warning("p2p stream handler %s failed: %r", name, error)
                    await send(RPCError(message=str(error) or repr(error)))

            with closing(writer):
                processing = asyncio.create_task(process_requests())
                receiving = None
                try:
                    while True:
                        receiving = asyncio.create_task(P2P.receive_protobuf(input_protobuf_type, reader))
                        await asyncio.wait({processing, receiving}, return_when=asyncio.FIRST_COMPLETED)
                        if not receiving.done():  # the handler is done: the caller closes once it has read it all
                            with suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(wait_until_closed(reader, receiving), STREAM_LINGER_SECONDS)
                            return
                        try:
                            request, _ = await receiving
                        except (asyncio.IncompleteReadError, ConnectionError):  # the caller closed (or died)
                            return
                        if not processing.done():
                            await requests.put(request)  # None for the caller's end-of-stream marker
                except Exception as error:
                    logger.warning("p2p stream handler %s: reading the requests failed: %r", name, error)
                finally:
                    if receiving is not None:
                        receiving.cancel()
                    processing.cancel()

        await self.add_binary_stream_handler(name, handle_stream, balanced=balanced)

    async def iterate_protobuf_stream_handler(self, peer_id, name, requests, output_protobuf_type):
        _, reader, writer = await self.call_binary_stream_handler(peer_id, name)

        async def write_requests():
            async for request in requests:
                await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        async def read_responses():
            with closing(writer):
                try:
                    while True:
                        try:
                            response, error = await P2P.receive_protobuf(output_protobuf_type, reader)
                        except asyncio.IncompleteReadError:
                            raise StreamCutShort(
                                f"the stream of handler `{name}` at {peer_id} ended before its end marker: the peer "
                                "stopped or its connection broke mid-stream"
                            ) from None
                        if error == P2P.END_OF_STREAM:
                            break
                        if error is not None:
                            raise P2PHandlerError(f"Failed to call handler `{name}` at {peer_id}: {error.message}")
                        yield response
                finally:
                    writing.cancel()  # a finished handler reads no more requests
                    await asyncio.gather(writing, return_exceptions=True)

        writing = asyncio.create_task(write_requests())
        return read_responses()

    P2P._add_protobuf_stream_handler = add_protobuf_stream_handler
    P2P._iterate_protobuf_stream_handler = iterate_protobuf_stream_handler
    P2P._delivers_whole_streams = True


def verify_state_downloads() -> None:
    """Serve every state download with per-tensor digests, and use a downloaded state only if it matches them.

    hivemind's state download carries no checksum: whatever a receiver assembles from the parts it got is loaded
    (issue 46: a donor killed mid-transfer left a tensor of half its size, the run saw it only because the size
    was wrong). Here the donor's background thread -- hivemind's own, which hands the averager process the state to
    stream -- adds digests to the state's metadata, computed over a snapshot once per served step
    (``common.state_integrity``), and serves that snapshot; the receiver's ``_load_state_from_peers`` is hivemind's
    loop with the check before it deserializes: a state that does not match, or comes without digests (a peer of
    another protocol), is one WARNING line and the next peer is asked, as is a stream cut short
    (:class:`StreamCutShort`). Everything that loads state goes through it: trainers, auxiliary peers and the
    monitor's checkpoints. Both sides must run it (every peer of this project does: :func:`deliver_whole_streams`
    installs it). Upstream hivemind has no state checksum as of 1.1.12; remove this when it gets one.
    Patched before any averager is built (its thread is started in its constructor) or forked; calling it again
    does nothing.
    """
    from hivemind.averaging import averager as averager_module
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import aiter_with_timeout
    from hivemind.utils.streaming import combine_from_streaming
    from hivemind.utils.timed_storage import ValueWithExpiration

    from common import state_integrity

    if getattr(DecentralizedAverager, "_verifies_state_downloads", False):
        return
    averager_logger = logging.getLogger("hivemind.averaging.averager")

    def _background_thread_fetch_current_state(serializer, pipe, get_current_state_ref):
        """hivemind's thread (host process), serving a snapshot of the state with its digests."""
        served = None
        while True:
            try:
                trigger, future = pipe.recv()
            except BaseException as error:
                averager_logger.debug(f"Averager background thread finished: {error!r}")
                break
            if trigger == "_SHUTDOWN":
                break
            try:
                get_current_state = get_current_state_ref()
                if get_current_state is None:
                    break
                averager = get_current_state.__self__
                state = tuple(get_current_state())
                del get_current_state
                metadata, tensors, infos = state + (None,) * (3 - len(state))
                with averager.lock_averaged_tensors:
                    served = state_integrity.served_state(
                        served, serializer.dumps(metadata), metadata, tensors, infos, averager.state_compression
                    )
                del averager, tensors
                metadata = serializer.dumps(state_integrity.with_digests(metadata, served.digests))
                future.set_result((metadata, served.tensors, infos))
            except BaseException as error:
                future.set_exception(error)
                averager_logger.warning(f"could not serve this peer's state: {error!r}")

    async def _load_state_from_peers(self, future, timeout=None):
        """hivemind 1.1.12's download loop; the state is checked against its digests before it is used."""
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            peer_priority, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            peer_priority = {
                PeerID(peer_id): (float(info.value), random.random())  # randomness breaks ties
                for peer_id, info in peer_priority.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
            }
            if not peer_priority:
                averager_logger.info(f"Averager could not load state from peers: peer dict empty {peer_priority}")
                return
            for peer in sorted(peer_priority.keys(), key=peer_priority.get, reverse=True):
                if peer == self.peer_id:
                    continue
                started = time.monotonic()
                averager_logger.info(f"Downloading parameters from peer {peer}")
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata, serialized, parts = None, [], []
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # the first part of the next tensor
                            serialized.append(combine_from_streaming(parts))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        serialized.append(combine_from_streaming(parts))
                    if not metadata:
                        averager_logger.debug(f"Peer {peer} did not send its state")
                        continue
                    problem = state_integrity.state_problem(metadata, serialized)
                    if problem is not None:
                        averager_logger.warning(
                            f"state downloaded from peer {peer} not used: {problem}; asking the next peer"
                        )
                        continue
                    tensors = [deserialize_torch_tensor(tensor) for tensor in serialized]
                    averager_logger.info(
                        f"Finished downloading state in {time.monotonic() - started:.3f}s from {peer} (verified)"
                    )
                    future.set_result((state_integrity.without_digests(metadata), tensors))
                    return
                except StreamCutShort as error:
                    averager_logger.warning(f"state download from peer {peer} not used: {error}; asking the next peer")
                except Exception as error:
                    averager_logger.exception(f"{STATE_DOWNLOAD_FAILED}{peer} - {error!r}")
        finally:
            if not future.done():
                future.set_result(None)

    averager_module._background_thread_fetch_current_state = _background_thread_fetch_current_state
    DecentralizedAverager._load_state_from_peers = _load_state_from_peers
    DecentralizedAverager._verifies_state_downloads = True
