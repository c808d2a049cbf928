"""Trainer role: computes gradients on its own data stream; the backend (from config) does the rest."""

from __future__ import annotations

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
from common.config import Backend, RunConfig, import_task_module
from common.context import RunContext
from common.lifecycle import StopFlag
from common.optimizer import make_collaborative_optimizer
from common.peer import link_bandwidth, start_peer_dht
from common.task import EXPORT_DIR, ExportFacts
from common.trainer import Trainer, TrainingSummary

logger = logging.getLogger(__name__)

FINAL_STATE_FILE = "final_model.pt"
SUMMARY_FILE = "summary.json"


def build_backend(
    config: RunConfig,
    context: RunContext,
    task,
    peer_name: str,
    config_path: str,
    stop: StopFlag,
    authorizer: Optional[AuthorizerBase] = None,
) -> TrainingBackend:
    """The backend ``training.backend`` names, each given the collaboration section (the global batch and the
    update rule) whole and the run context (fp16 gives it its library's loss scaler)."""
    collab = config.collaboration
    if config.training.backend == Backend.single:
        return SingleProcessBackend(task, collab, context.precision, history_dir=Path(config.training.output_dir))
    if config.training.backend == Backend.ddp:
        from common.ddp import DDPBackend  # imported lazily: only the baseline needs torch.distributed

        return DDPBackend(task, config.training, collab, context)
    dht = start_peer_dht(config, Path(config.training.output_dir), "scripts/train.py", config_path, authorizer, stop)
    fingerprints = RunFingerprints.of(task, collab)
    try:
        require_same_model(dht, collab.run_id, fingerprints, task.input_mismatch_advice)
        optimizer = make_collaborative_optimizer(
            dht,
            task,
            collab,
            config.training.local_batch_size,
            uses_grad_scaler=context.precision.loss_scaling,
            stop_requested=stop.is_set,
            run_id=averaging_run_id(collab.run_id, authorizer),  # the averagers' keys: tagged in a moderated run
            bandwidth=link_bandwidth(dht, config),
        )
    except BaseException:
        dht.shutdown()
        raise
    startup.mark("optimizer")
    backend = CollaborativeBackend(
        dht,
        optimizer,
        collab,
        peer_name,
        "trainer",
        config.monitor.metrics_expiration,
        fingerprints,
        grad_scaler=hivemind.GradScaler(context.device.type) if context.precision.loss_scaling else None,
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
    context = RunContext.resolve(config)  # the one place this process resolves its device, precision and seed
    context.seed_parameters()
    task = task_module.build_task(config)
    startup.mark("task: model and data")
    startup.write_to(output_dir)
    task.model.to(context.device)  # before the backend: optimizers, accumulators and hivemind's copies live beside it
    backend = build_backend(config, context, task, peer_name, config_path, stop, authorizer)
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
            config.training,
            context,
            peer_name=peer_name,
            stream_seed=context.stream_seed(stream_key),
            output_dir=output_dir,
            checkpoint_dir=checkpoint_dir,
            debug=config.debug,
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
