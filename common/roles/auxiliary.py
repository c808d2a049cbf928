"""Auxiliary role: a CPU peer with no data that takes a share of every all-reduce (the paper's section 3).

It must accept inbound connections (no client mode). Its loop calls ``step()`` often, so it pre-schedules
matchmaking as soon as the swarm's next step is near and does not miss rounds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch
from hivemind.utils.auth import AuthorizerBase

from common.auth import averaging_run_id
from common.backends import RunFingerprints, publish_averaging_settings, require_same_model
from common.config import RunConfig, import_task_module
from common.dht import announce_swarm_step, visible_multiaddrs
from common.errors import PeerError
from common.lifecycle import StopFlag
from common.optimizer import make_collaborative_optimizer
from common.peer import announce_entry_peer, start_peer_dht

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# After SIGINT/SIGTERM, the round in progress gets this long to finish; then the peer leaves without waiting for
# rounds nobody will join (at the end of a run it would otherwise block for collaboration.averaging_timeout).
LEAVE_WITHIN_SECONDS = 5.0
# an auxiliary peer accepts connections for the whole run: it announces its addresses as a way in (the monitor lists
# them in its join command) and the global step it follows this often (and each new step at once), each
# announcement valid for ENTRY_LIFETIME_SECONDS
ENTRY_ANNOUNCE_SECONDS = 30.0
ENTRY_LIFETIME_SECONDS = 90.0


def leave_promptly_when_stopped(
    stop: StopFlag, finished: threading.Event, leaving: threading.Event, leave_now: Callable[[], None]
) -> threading.Thread:
    """An auxiliary peer holds no state of its own, so once stopped it may abandon a blocked averaging round, in its
    training loop or in ``Optimizer.shutdown`` (which waits up to ``averaging_timeout`` for a scheduled round, all
    the time such a round takes when no trainer is left to join it). ``finished`` is set once the peer has shut down
    in order; ``leaving`` tells the main thread that the averagers are being stopped under it: whatever its blocked
    call then raises is expected, and this thread ends the process."""

    def watch() -> None:
        while not stop.wait(0.5):
            if finished.is_set():
                return
        if finished.wait(LEAVE_WITHIN_SECONDS):
            return
        logger.info(f"still waiting for an averaging round {LEAVE_WITHIN_SECONDS:.0f} s after the stop: leaving now")
        leaving.set()
        leave_now()
        os._exit(0)

    watcher = threading.Thread(target=watch, name="leave-when-stopped", daemon=True)
    watcher.start()
    return watcher


def run_auxiliary(
    config: RunConfig, config_path: str, stop: StopFlag, authorizer: Optional[AuthorizerBase] = None
) -> None:
    if config.network.client_mode:
        raise PeerError("an auxiliary peer must accept inbound connections: set network.client_mode=false")
    torch.set_num_threads(config.training.num_threads)
    output_dir = Path(config.training.output_dir)
    dht = start_peer_dht(config, output_dir, "scripts/train.py", config_path, authorizer, stop)
    optimizer = None
    finished, leaving = threading.Event(), threading.Event()

    def leave_now() -> None:
        """End this peer's averager and DHT processes and p2pd without waiting for a round. Not through their
        ``shutdown``: an averager shut down while it looks for a group fails inside hivemind with a traceback."""
        logging.shutdown()  # the process ends right after: a thread of it may fail on a pipe to a killed child
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    leave_promptly_when_stopped(stop, finished, leaving, leave_now)
    try:
        torch.manual_seed(config.training.seed)
        task = import_task_module(config.task_module).build_task(config, with_data=False)
        # it takes a share of every round, so it must form its updates as the trainers do (diloco's H and outer
        # optimizer): refused like a trainer with other settings, and announced so that such a trainer is refused
        fingerprints = RunFingerprints.of(task, config.collaboration)
        require_same_model(dht, config.collaboration.run_id, fingerprints, task.input_mismatch_advice)
        optimizer = make_collaborative_optimizer(
            dht,
            task,
            config.collaboration,
            None,
            auxiliary=True,
            run_id=averaging_run_id(config.collaboration.run_id, authorizer),  # tagged in a moderated run
        )
        started, steps_seen, last_epoch = time.time(), 0, optimizer.local_epoch
        logger.info("auxiliary peer running: assisting in averaging")
        entry_addresses, next_announcement = visible_multiaddrs(dht), 0.0
        while not stop.is_set():
            if time.monotonic() >= next_announcement:
                announce_entry_peer(dht, config.collaboration.run_id, entry_addresses, ENTRY_LIFETIME_SECONDS)
                announce_swarm_step(dht, config.collaboration.run_id, optimizer.local_epoch, ENTRY_LIFETIME_SECONDS)
                publish_averaging_settings(
                    dht, config.collaboration.run_id, "auxiliary", fingerprints.averaging, ENTRY_LIFETIME_SECONDS
                )
                next_announcement = time.monotonic() + ENTRY_ANNOUNCE_SECONDS
            optimizer.step()
            if optimizer.local_epoch != last_epoch:
                steps_seen += 1
                last_epoch = optimizer.local_epoch
                logger.info(f"assisted global step {last_epoch - 1}")
                announce_swarm_step(dht, config.collaboration.run_id, last_epoch, ENTRY_LIFETIME_SECONDS)
            if optimizer.local_epoch >= config.training.max_global_steps:
                # step() returns once this peer has reduced its share of the last round, while p2pd may still be
                # sending the averaged share to slow trainers: leaving at once cuts it off, and the trainers keep
                # their own values for it (a partial round). Stay as long as the trainers' final averaging waits
                stop.wait(config.collaboration.final_averaging_seconds)
                break
            time.sleep(POLL_SECONDS)
        summary = {
            "role": "auxiliary",
            "final_step": optimizer.local_epoch,
            "steps_seen": steps_seen,
            "wall_seconds": time.time() - started,
        }
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        stop.set()  # from here on the peer is leaving, for whatever reason: the watcher bounds how long that takes
        try:
            if optimizer is not None:
                optimizer.shutdown()
            dht.shutdown()
        finally:
            finished.set()
            if leaving.is_set():  # whatever failed, failed because the watcher stopped the averagers: it exits 0
                threading.Event().wait()
