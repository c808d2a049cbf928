"""Auxiliary role: a CPU peer with no data that takes a share of every all-reduce (the paper's section 3).

It must accept inbound connections (no client mode). Its loop calls ``step()`` often, so it pre-schedules
matchmaking as soon as the swarm's next step is near and does not miss rounds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from hivemind.utils.auth import AuthorizerBase

from common.auth import averaging_run_id
from common.config import RunConfig, import_task_module
from common.errors import PeerError
from common.lifecycle import StopFlag
from common.optimizer import make_collaborative_optimizer
from common.peer import start_peer_dht

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
# After SIGINT/SIGTERM, the round in progress gets this long to finish; then the peer leaves without waiting for
# rounds nobody will join (at the end of a run it would otherwise block for collaboration.averaging_timeout).
LEAVE_WITHIN_SECONDS = 5.0


def leave_promptly_when_stopped(
    stop: StopFlag, finished: threading.Event, leaving: threading.Event, shutdown
) -> threading.Thread:
    """An auxiliary peer holds no state of its own, so once stopped it may abandon a blocked averaging round.
    ``leaving`` tells the main thread that the optimizer is being shut down under it: whatever its blocked step
    then raises is expected, and this thread ends the process."""

    def watch() -> None:
        while not stop.wait(0.5):
            if finished.is_set():
                return
        if finished.wait(LEAVE_WITHIN_SECONDS):
            return
        logger.info(f"still waiting for an averaging round {LEAVE_WITHIN_SECONDS:.0f} s after the stop: leaving now")
        leaving.set()
        shutdown()
        logging.shutdown()
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
    dht = start_peer_dht(config, output_dir, "scripts/train.py", config_path, authorizer)
    optimizer = None
    finished, leaving, shut_down, shutting_down = (
        threading.Event(),
        threading.Event(),
        threading.Event(),
        threading.Lock(),
    )

    def shutdown() -> None:  # once, from whichever thread gets here first (the other waits for it)
        with shutting_down:
            if shut_down.is_set():
                return
            shut_down.set()
            if optimizer is not None:
                optimizer.shutdown()
            dht.shutdown()

    leave_promptly_when_stopped(stop, finished, leaving, shutdown)
    try:
        torch.manual_seed(config.training.seed)
        task = import_task_module(config.task_module).build_task(config, with_data=False)
        collab = dataclasses.replace(  # a moderated run's averaging prefixes carry its run secret
            config.collaboration, run_id=averaging_run_id(config.collaboration.run_id, authorizer)
        )
        optimizer = make_collaborative_optimizer(dht, task, collab, None, auxiliary=True)
        started, steps_seen, last_epoch = time.time(), 0, optimizer.local_epoch
        logger.info("auxiliary peer running: assisting in averaging")
        while not stop.is_set():
            optimizer.step()
            if optimizer.local_epoch != last_epoch:
                steps_seen += 1
                last_epoch = optimizer.local_epoch
                logger.info(f"assisted global step {last_epoch - 1}")
            if optimizer.local_epoch >= config.training.max_global_steps:
                break
            time.sleep(POLL_SECONDS)
        summary = {
            "role": "auxiliary",
            "final_step": optimizer.local_epoch,
            "steps_seen": steps_seen,
            "wall_seconds": time.time() - started,
        }
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    except Exception:
        if leaving.is_set():  # the step failed because the optimizer was shut down under it: the watcher exits 0
            threading.Event().wait()
        raise
    finally:
        finished.set()
        shutdown()
