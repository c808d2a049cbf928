"""Our policies: where this project chooses other behaviour than hivemind 1.1.12's, which is not wrong as such.

Log levels (a routine event that hivemind logs as an ERROR with a traceback becomes one INFO or WARNING line; any
other record keeps its level), the state-download deadline, the catch-up rule, the timing of gradient rounds, the
key records are signed with. Process-wide ones take a :class:`Patcher` and are installed by
``common.hivemind_patches.install``; the others adapt one ``hivemind.Optimizer`` (``make_collaborative_optimizer``) or
are called with the peer's identity (``common.peer``). None changes what goes over the wire.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import types
import warnings
from concurrent.futures import InvalidStateError
from typing import Callable

import hivemind
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.crypto import RSAPrivateKey

from common.errors import PeerError
from common.hivemind_patches.fixes import DETACH_FROM_SENDER, STATE_DOWNLOAD_FAILED
from common.hivemind_patches.patcher import Patcher

logger = logging.getLogger(__name__)


def silence_schedule_fast_forward_warning(patcher: Patcher) -> None:
    """Hide torch's "lr_scheduler.step() before optimizer.step()" warning.

    Why: a late joiner's downloaded state fast-forwards its LR schedule to the swarm's step; hivemind steps the
    scheduler without an optimizer step, which is intended, but torch warns as if the call order were wrong."""
    message = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
    warnings.filterwarnings("ignore", message=message)
    added = warnings.filters[0]

    def remove() -> None:
        if added in warnings.filters:
            warnings.filters.remove(added)
            warnings._filters_mutated()

    patcher.on_undo(remove)


class _RequestFromExitedProcess(logging.Filter):
    """Rewrites the record described in :func:`quiet_requests_from_exited_processes` as an INFO line."""

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


def quiet_requests_from_exited_processes(patcher: Patcher) -> None:
    """Log hivemind's "request from an exited process" as one INFO line.

    Why: a request to the DHT process carries a reply pipe handle fetched from the sender's resource sharer; an
    averager being shut down can exit before the DHT reads its request, and ``DHT.run`` logs an ERROR with a
    traceback. Nobody waits for that reply any more and the DHT goes on serving (with the fix
    ``report_vanished_handle_senders``). Only that exact record is rewritten.
    """
    patcher.add_filter("hivemind.dht.dht", _RequestFromExitedProcess())


GROUPLESS_ROUND = "Averaging step failed: could not find a group"


class _GrouplessRound(logging.Filter):
    """Rewrites the record described in :func:`log_groupless_rounds_as_warnings` as a one-line WARNING."""

    MESSAGES = {
        "_step": "averaging round ended without partners (no group formed in time)",
        "_tag_along_with_zero_weight": "a round joined with zero weight to catch up ended without partners",
    }

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            record.funcName in self.MESSAGES
            and type(error).__name__ == "AllreduceException"
            and str(error) == GROUPLESS_ROUND
        ):
            record.msg, record.args = self.MESSAGES[record.funcName], ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_groupless_rounds_as_warnings(patcher: Patcher) -> None:
    """Log "could not find a group" as one WARNING line instead of an ERROR with a
    traceback.

    Why: nothing failed inside this peer (its partners did not come in time: routine for the last round when the
    swarm stops, or when peers leave); ``hivemind.Optimizer`` reports the outcome itself and the trainer warns when
    a step used local gradients only. The same holds for the round a peer that fell behind joins with zero weight
    before it loads the swarm's state (``Optimizer._tag_along_with_zero_weight`` logs that one). Any other
    averaging error keeps its level and traceback.
    """
    patcher.add_filter("hivemind.averaging.averager", _GrouplessRound())
    patcher.add_filter("hivemind.optim.optimizer", _GrouplessRound())


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


def log_unreachable_state_sources_as_info(patcher: Patcher) -> None:
    """Log a state download from a peer that could not be reached, or sent
    nothing in time, as one INFO line.

    Why: ``_load_state_from_peers`` asks the peers one after another and logs each failure with a traceback; a
    ``ControlFailure`` ("routing: not found" for a peer that joined seconds ago, "dial backoff" for one that left)
    or a ``TimeoutError`` is routine, the averager goes on to the next peer, and the caller reports the outcome
    when it matters. Any other download error keeps its level and traceback.
    """
    patcher.add_filter("hivemind.averaging.averager", _UnreachableStateSource())


ENDED_AVERAGER = "Averager shutdown has no effect: the process is already not alive"


class _EndedAverager(logging.Filter):
    """Rewrites the record described in :func:`log_ended_averagers_as_warnings` as a one-line WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName == "shutdown" and record.getMessage() == ENDED_AVERAGER:
            record.msg, record.args = "an averager process had already ended when the peer shut it down", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_ended_averagers_as_warnings(patcher: Patcher) -> None:
    """Log "averager shutdown has no effect" as one WARNING line instead of an ERROR
    with an empty traceback.

    Why: a SIGTERM to a peer's whole process group ends its forked averager processes too, so
    ``Optimizer.shutdown`` finds them gone; nothing is left to stop. It stays a WARNING because an averager process
    that died on its own is worth knowing about.
    """
    patcher.add_filter("hivemind.averaging.averager", _EndedAverager())


class _RoundFinishedAfterCancel(logging.Filter):
    """Two routine faults asyncio logs as "Task exception was never retrieved" with a traceback; one INFO line each
    instead (every other unretrieved exception keeps its level and traceback):

    * hivemind's averager sets the result of an all-reduce round on its step future without checking whether the
      optimizer cancelled that step meanwhile (an auxiliary peer's pre-scheduled round it no longer needs, a peer
      stopping): ``InvalidStateError: Can't set_result to a future that is CANCELLED``. Nobody waits for the result.
    * a request with a timeout (``asyncio.wait_for``) run as a task whose caller stopped waiting (a peer that left,
      a start-up attempt given up): the ``TimeoutError`` is the request's routine end.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        unretrieved = str(record.msg).split("\n", 1)[0] in UNRETRIEVED
        if isinstance(error, InvalidStateError) and "CANCELLED" in str(error):
            self._one_line(record, "an averaging round finished after its step was cancelled: result dropped")
        elif unretrieved and isinstance(error, TimeoutError) and "wait_for()" in str(record.msg):
            self._one_line(record, "a request timed out after its caller had stopped waiting for it")
        elif unretrieved and isinstance(error, asyncio.CancelledError):
            self._one_line(record, "a part of an averaging round was abandoned when the round was cut off")
        return True

    @staticmethod
    def _one_line(record: logging.LogRecord, message: str) -> None:
        record.msg, record.args = message, ()
        record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        record.exc_info, record.exc_text = None, None


UNRETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")


class _AllReduceCutOff(logging.Filter):
    """hivemind logs an all-reduce round cut off at its timeout (a groupmate frozen or gone mid-round: its parts
    never came) with ``logger.exception``: "Unable to run All-Reduce:" and two chained tracebacks. The optimizer
    reports the outcome itself ("Averaging failed with ..."); one WARNING line instead. Other failures keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        cause = error.__cause__ or error.__context__ if error is not None else None
        if "Unable to run All-Reduce" in str(record.msg) and isinstance(cause, (asyncio.CancelledError, TimeoutError)):
            record.msg, record.args = (
                "an all-reduce round was cut off at its timeout: a groupmate stopped answering",
                (),
            )
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.exc_info, record.exc_text = None, None
        return True


def log_rounds_finished_after_cancel_in_one_line(patcher: Patcher) -> None:
    """Log the routine faults of :class:`_RoundFinishedAfterCancel` and :class:`_AllReduceCutOff` in one line each.

    Why: each is a routine end (a cancelled step, a request nobody waits for, a round cut off at its timeout) that
    hivemind or asyncio logs with a traceback, while the optimizer reports the outcome itself."""
    patcher.add_filter("asyncio", _RoundFinishedAfterCancel())
    patcher.add_filter("hivemind.averaging.averager", _AllReduceCutOff())


# (name, function) in the order ``install`` applies them
PROCESS_WIDE = (
    ("silence_schedule_fast_forward_warning", silence_schedule_fast_forward_warning),
    ("quiet_requests_from_exited_processes", quiet_requests_from_exited_processes),
    ("log_groupless_rounds_as_warnings", log_groupless_rounds_as_warnings),
    ("log_unreachable_state_sources_as_info", log_unreachable_state_sources_as_info),
    ("log_ended_averagers_as_warnings", log_ended_averagers_as_warnings),
    ("log_rounds_finished_after_cancel_in_one_line", log_rounds_finished_after_cancel_in_one_line),
)


def rsa_private_key_from_der(der: bytes) -> RSAPrivateKey:
    """An existing RSA key (a peer identity file) as hivemind's ``RSAPrivateKey``.

    hivemind's class can only generate a fresh key; its pickling state is the DER encoding, so restoring that state
    is how an existing key becomes one (private API: re-check on upgrade)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def sign_with_identity_key(private_key: RSAPrivateKey) -> None:
    """Make ``private_key`` the process-wide key hivemind signs with.

    Why: ``RSASignatureValidator`` (metrics and progress records), the progress tracker and access-token
    authorizers default to ``RSAPrivateKey.process_wide()``, a random key per process unrelated to the libp2p
    identity. Installing the identity key there (before any of them is built) makes a peer's records and tokens name
    its peer id, so the monitor keys contributions by peer id and a restarted peer keeps it. Called by
    ``common.peer`` with the key it loaded.
    """
    with RSAPrivateKey._process_wide_key_lock:
        current = RSAPrivateKey._process_wide_key
        if current is not None and current is not private_key and current.to_bytes() != private_key.to_bytes():
            raise RuntimeError("hivemind's process-wide key was already used before the peer identity was loaded")
        RSAPrivateKey._process_wide_key = private_key


def count_state_reloads(optimizer: hivemind.Optimizer, on_reload: Callable[[], None]) -> None:
    """Call ``on_reload`` whenever the optimizer replaces this peer's state with the swarm's.

    Why: ``Optimizer.step`` reloads state from peers by itself when this peer fell behind, discarding the gradients
    it had accumulated, and nothing in its return value says so; the loop must know, or it would credit those
    micro-batches to a step they never reached. Our accounting, not a hivemind fault. Per optimizer.
    """
    reload_state = optimizer.load_state_from_peers

    def counted_reload(**kwargs):
        on_reload()
        return reload_state(**kwargs)

    optimizer.load_state_from_peers = counted_reload


def restart_throughput_timer(optimizer: hivemind.Optimizer) -> None:
    """Start the peer's throughput estimate now, not when the optimizer was built.

    Why: hivemind times the first micro-batch from the optimizer's creation, so a wait before training (a start
    barrier, a state download) counts as training time: the progress tracker then expects the step to take
    minutes, refreshes rarely, and a short first step can end before this peer has seen the others. Only the
    caller knows when training starts. Per optimizer.
    """
    optimizer.tracker.performance_ema.reset_timer()


STATE_RETRY_MAX_SECONDS = 16.0  # longest wait between two attempts to download the swarm's state
STOP_POLL_SECONDS = 0.25  # how often a wait between attempts checks whether the peer was asked to stop


def bound_state_downloads(
    optimizer: hivemind.Optimizer,
    deadline: float,
    stop_requested: Callable[[], bool] = lambda: False,
    announced_step: Callable[[], int] = lambda: -1,
    *,
    holders_gone_after: float,
) -> None:
    """Make ``optimizer.load_state_from_peers`` retry with backoff and give up after
    ``deadline`` seconds with one line (``PeerError``).

    Why: hivemind's method retries a failed download at once and forever, logging a traceback each time, and
    ``Optimizer.step`` calls it by itself whenever this peer fell behind, so a peer that can never get the state
    spins silently (upstream: unchanged on master). The replacement does what hivemind's does around the download
    -- join a running gradient round with zero weight, finish delayed updates, pause the progress tracker, take the
    swarm's step if one behind, report progress, share state at its new step, drop accumulated gradients -- but
    retries after 1, 2, 4 ... s (at most ``STATE_RETRY_MAX_SECONDS``) with one WARNING line per failed attempt,
    until ``collaboration.load_state_deadline``. An attempt that loaded nothing newer while the swarm is more than
    one step ahead failed too; after ``holders_gone_after`` seconds of those (every peer holding the swarm's
    state crashed while an auxiliary peer announces its step), the peer goes on at the swarm's step from the newest
    state served. That wait is the lifetime of a progress record (``collaboration.progress_expiration``): crashed
    trainers' records keep the swarm's step in the DHT as long. The swarm's step is the highest of hivemind's
    progress records and ``announced_step()`` (what live auxiliary peers, which follow the step without holding its
    state, announce: hivemind's records come from peers with samples only, so without it the step is forgotten
    once the last trainer's record expired, and a newcomer would go on from an older step than the one the swarm's
    history reached; ``common.dht.announce_swarm_step``). A stop request ends the waiting. Installed as an
    instance attribute, so ``Optimizer.step`` calls it too.
    """

    def load_state_from_peers(**kwargs) -> None:
        _load_state_within_deadline(optimizer, deadline, stop_requested, kwargs, announced_step, holders_gone_after)

    optimizer.load_state_from_peers = load_state_from_peers


def _load_state_within_deadline(
    optimizer: hivemind.Optimizer,
    deadline: float,
    stop_requested: Callable[[], bool],
    kwargs: dict,
    announced_step: Callable[[], int],
    holders_gone_after: float,
) -> None:
    # tag along with a gradient round already under way: cancelling it would restart everyone's matchmaking
    if optimizer.scheduled_grads is not None and not optimizer.scheduled_grads.done():
        optimizer._tag_along_with_zero_weight(optimizer.scheduled_grads)
        optimizer.scheduled_grads = None
    optimizer.state_averager.step(wait_for_delayed_updates=True)

    with optimizer.tracker.pause_updates():
        swarm_epoch = _download_state(optimizer, deadline, stop_requested, kwargs, announced_step, holders_gone_after)
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
    optimizer: hivemind.Optimizer,
    deadline: float,
    stop_requested: Callable[[], bool],
    kwargs: dict,
    announced_step: Callable[[], int] = lambda: -1,
    holders_gone_after: float = 60.0,
) -> int:
    """Attempts until one succeeds; each gets at most ``load_state_timeout`` and never runs past ``deadline``.
    Returns the swarm's step the last attempt was judged against."""
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
            swarm_epoch = max(optimizer.tracker.global_epoch, announced_step())
            if optimizer.local_epoch >= swarm_epoch - 1:
                return swarm_epoch
            if behind_since is None or optimizer.local_epoch > epoch_before:
                behind_since = time.monotonic()  # the wait for the swarm's state runs from the newest state served
            elif time.monotonic() - behind_since >= holders_gone_after:
                logger.warning(
                    f"no peer has served the swarm's state of global step {swarm_epoch} for "
                    f"{holders_gone_after:.0f} s: the peers that held it left; continuing at global step "
                    f"{swarm_epoch} from the newest state served (global step {optimizer.local_epoch})"
                )
                optimizer.state_averager.local_epoch = swarm_epoch
                return swarm_epoch
            newer = (
                "the newest state served is"
                if optimizer.local_epoch > epoch_before
                else "no peer served a state newer than"
            )
            failure = f"{newer} global step {optimizer.local_epoch} (the swarm is at global step {swarm_epoch})"
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
                return optimizer.tracker.global_epoch
            time.sleep(min(STOP_POLL_SECONDS, max(waited_until - time.monotonic(), 0.0)))


def _attempt_timeout(optimizer: hivemind.Optimizer, give_up_at: float) -> float:
    """``load_state_timeout``, cut short so that no attempt runs past the deadline (the averager's own download then
    finishes in the background and is dropped)."""
    return min(optimizer.load_state_timeout, max(give_up_at - time.monotonic(), 0.1))


def catch_up_one_step_behind(optimizer: hivemind.Optimizer) -> None:
    """Let a trainer one global step behind right after its own update catch up by
    stepping, not by reloading (opt-in: ``collaboration.catch_up_one_step_behind``).

    Why: right after its update ``hivemind.Optimizer`` requires a trainer's epoch to equal the swarm's exactly; one
    step behind it downloads the whole state and drops its accumulated gradients. At any other time it tolerates
    one step behind (the trainer finishes its step and is level again). A trainer whose update ran a second past a
    swarm-mate's is routinely one step behind at that check; this applies the tolerant rule there too. Two or more
    steps behind still reloads. Measurements: paper_results/core/hivemind_patches.md. Per optimizer.
    """

    def should_load_state_from_peers(self: hivemind.Optimizer) -> bool:
        # spend the exact check where hivemind would, so that its tolerant rule decides
        if self._should_check_synchronization_on_update and self.tracker.fetched_global_progress_this_epoch.is_set():
            self._should_check_synchronization_on_update = False
        return hivemind.Optimizer._should_load_state_from_peers(self)

    optimizer._should_load_state_from_peers = types.MethodType(should_load_state_from_peers, optimizer)


def gradient_rounds_start_at_the_update(optimizer: hivemind.Optimizer) -> None:
    """With delayed gradient averaging (``dpu``), start each gradient round at
    the trainer's update, never before it.

    Why: with ``delay_grad_averaging`` a trainer pre-schedules the next round while the previous one still runs;
    when that one ends, the averager's shared ``_pending_groups_registered`` event is set, and every early part of
    the new group is answered BAD_GROUP_ID, so most rounds average only part of the gradient over the whole group.
    Here no trainer pre-schedules: the update waits for the previous delayed update, then starts a round, and all
    trainers do so within a fraction of a second, well inside the matchmaking time. The cost: matchmaking no longer
    overlaps the last micro-batches. Also, where hivemind would apply the trainer's own gradients as the average
    because the only control it holds is the previous step's ("Not using pre-scheduled group for state
    averaging"), that control is dropped and a round starts. A timing policy over a hivemind fault (the shared
    event, unchanged on master 4bd43b7); measurements: paper_results/core/hivemind_patches.md. Per optimizer,
    ``dpu`` only.
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
