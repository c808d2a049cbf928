"""Trainer role: computes gradients on its own data stream; the backend (from config) does the rest."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

import hivemind
import torch
from hivemind.utils.auth import AuthorizerBase

from common import startup
from common.auth import averaging_run_id
from common.backends import (
    CollaborativeBackend,
    RunFingerprints,
    SingleProcessBackend,
    TrainingBackend,
    require_same_model,
)
from common.checkpoints import CHECKPOINT_DIR, resume_from_checkpoint
from common.config import Backend, RunConfig, Semantics, import_task_module
from common.lifecycle import StopFlag
from common.optimizer import make_collaborative_optimizer
from common.peer import device_for, link_bandwidth, start_peer_dht
from common.precision import needs_loss_scaling, resolve_precision
from common.seeding import stable_seed
from common.task import EXPORT_DIR, ExportFacts
from common.trainer import Trainer, TrainingSummary

logger = logging.getLogger(__name__)

FINAL_STATE_FILE = "final_model.pt"
SUMMARY_FILE = "summary.json"


def build_backend(
    config: RunConfig,
    task,
    peer_name: str,
    output_dir: Path,
    config_path: str,
    stop: StopFlag,
    authorizer: Optional[AuthorizerBase] = None,
    precision: str = "fp32",
) -> TrainingBackend:
    """``precision``: resolved (fp32, fp16 or bf16); fp16 gives the backend its loss scaler."""
    if config.training.backend == Backend.single:
        return SingleProcessBackend(
            task,
            config.collaboration.target_batch_size,
            history_dir=output_dir,
            precision=precision,
            delayed_updates=config.collaboration.semantics == Semantics.dpu,
        )
    if config.training.backend == Backend.ddp:
        from common.ddp import DDPBackend  # imported lazily: only the baseline needs torch.distributed

        return DDPBackend(task, config, precision)
    dht = start_peer_dht(config, output_dir, "scripts/train.py", config_path, authorizer, stop)
    fingerprints = RunFingerprints.of(task, config.collaboration)
    try:
        require_same_model(dht, config.collaboration.run_id, fingerprints, task.input_mismatch_advice)
        collab = dataclasses.replace(
            config.collaboration,
            bandwidth=link_bandwidth(dht, config),
            run_id=averaging_run_id(config.collaboration.run_id, authorizer),  # tagged in a moderated run
        )
        optimizer = make_collaborative_optimizer(
            dht,
            task,
            collab,
            config.training.local_batch_size,
            uses_grad_scaler=needs_loss_scaling(precision),
            stop_requested=stop.is_set,
        )
    except BaseException:
        dht.shutdown()
        raise
    startup.mark("optimizer")
    backend = CollaborativeBackend(
        dht,
        optimizer,
        config.collaboration,
        peer_name,
        "trainer",
        config.monitor.metrics_expiration,
        fingerprints,
        grad_scaler=hivemind.GradScaler(device_for(config).type) if needs_loss_scaling(precision) else None,
    )
    try:
        backend.catch_up()
        startup.mark("state download")
        backend.wait_for_swarm(stop.is_set)
        startup.mark("start barrier")
    except BaseException:
        backend.shutdown()
        raise
    return backend


def export_final_model(config: RunConfig, task, trainer: Trainer, summary: TrainingSummary, folder: Path) -> None:
    """The final weights in the task's ecosystem format (a Hugging Face folder for ALBERT), if it has one. A
    trainer knows only its own share of a collaborative run: its card counts the swarm's samples as global steps x
    target batch and lists this peer alone (the monitor's card lists every contributor)."""
    last = trainer.records[-1] if trainer.records else None
    facts = ExportFacts(
        run_id=config.collaboration.run_id,
        global_step=summary.global_steps,
        samples=summary.global_steps * config.collaboration.target_batch_size,
        exported_by=f"the trainer peer {summary.peer_name!r} at the end of its run",
        backend=config.training.backend.value,
        final_loss=last.loss if last is not None else None,
        loss_step=last.step if last is not None else None,
        metrics=dict(last.metrics) if last is not None else {},
        contributors=[{"peer": summary.peer_name, "samples": summary.samples, "steps": len(trainer.records)}],
    )
    task.export_pretrained(task.model, folder, facts)


def run_trainer(
    config: RunConfig, config_path: str, peer_name: str, stop: StopFlag, authorizer: Optional[AuthorizerBase] = None
) -> TrainingSummary:
    torch.set_num_threads(config.training.num_threads)
    output_dir = Path(config.training.output_dir)
    task_module = import_task_module(config.task_module)
    torch.manual_seed(config.training.seed)  # every peer starts from the same initial parameters
    device = device_for(config)
    precision = resolve_precision(config.training.precision, device, config.debug.fp16_on_cpu)
    task = task_module.build_task(config)
    startup.mark("task: model and data")
    startup.write_to(output_dir)
    task.model.to(device)  # before the backend: optimizers, accumulators and hivemind's copies live beside it
    backend = build_backend(config, task, peer_name, output_dir, config_path, stop, authorizer, precision)
    checkpoint_dir = output_dir / CHECKPOINT_DIR
    baseline = config.training.backend != Backend.collaborative  # a swarm resumes from its peers or the monitor
    resumed_step = (
        resume_from_checkpoint(backend, checkpoint_dir) if baseline and config.training.checkpoint_every_steps else 0
    )
    # Each peer's data order derives from its identity (its peer id; hivemind's own example seeds by public key),
    # so volunteers who all run the same printed command, or share a name, never train on the same batches.
    stream_key = str(backend.dht.peer_id) if isinstance(backend, CollaborativeBackend) else peer_name
    if backend.worker_label is not None:  # one folder and data stream per DDP worker
        peer_name, output_dir = f"{peer_name}-{backend.worker_label}", output_dir / backend.worker_label
        stream_key = peer_name
    if resumed_step:  # a fresh sample order after a restart (replaying the consumed one would cost its loading time)
        stream_key = f"{stream_key} resumed at step {resumed_step}"
    try:
        trainer = Trainer(
            task,
            backend,
            peer_name=peer_name,
            stream_seed=stable_seed(config.training.seed, stream_key),
            max_global_steps=config.training.max_global_steps,
            max_wall_seconds=config.training.max_wall_seconds,
            output_dir=output_dir,
            device=device,
            precision=precision,
            log_every_seconds=config.training.log_every_seconds,
            record_sample_ids=config.debug.record_sample_ids,
            skip_nonfinite=config.training.skip_nonfinite,
            inject_nonfinite_every=config.debug.inject_nonfinite_every,
            inject_overflow_at_step=config.debug.inject_overflow_at_step,
            dataloader_workers=config.training.dataloader_workers,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_steps=config.training.checkpoint_every_steps,
            keep_checkpoints=config.training.keep_checkpoints,
            stop=stop,
        )
        summary = trainer.run()
        backend.finalize(wait=not stop.is_set())
        if summary.stopped_by == "max_global_steps":
            backend.average_final_parameters()
        torch.save(task.model.state_dict(), output_dir / FINAL_STATE_FILE)
        (output_dir / SUMMARY_FILE).write_text(json.dumps(summary.to_json(), indent=2))
        export_final_model(config, task, trainer, summary, output_dir / EXPORT_DIR)
        return summary
    finally:
        backend.shutdown()
