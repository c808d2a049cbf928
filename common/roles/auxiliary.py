"""Auxiliary role: a CPU peer with no data that takes a share of every all-reduce (DESIGN.md section 1).

It must accept inbound connections (no client mode). Its loop calls ``step()`` often, so it pre-schedules
matchmaking as soon as the swarm's next step is near and does not miss rounds.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from common.config import RunConfig, import_task_module
from common.errors import PeerError
from common.lifecycle import StopFlag
from common.optimizer import make_collaborative_optimizer
from common.peer import start_peer_dht

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


def run_auxiliary(config: RunConfig, config_path: str, stop: StopFlag) -> None:
    if config.network.client_mode:
        raise PeerError("an auxiliary peer must accept inbound connections: set network.client_mode=false")
    torch.set_num_threads(config.training.num_threads)
    output_dir = Path(config.training.output_dir)
    dht = start_peer_dht(config, output_dir, "scripts/train.py", config_path)
    optimizer = None
    try:
        torch.manual_seed(config.training.seed)
        task = import_task_module(config.task_module).build_task(config, with_data=False)
        optimizer = make_collaborative_optimizer(dht, task, config.collaboration, None, auxiliary=True)
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
        summary = {"role": "auxiliary", "final_step": optimizer.local_epoch, "steps_seen": steps_seen,
                   "wall_seconds": time.time() - started}
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
