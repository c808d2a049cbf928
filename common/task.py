"""The experiment interface: what an experiment (ALBERT, SwAV, ...) gives the one training loop."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn

from common.errors import DataError

Batch = Dict[str, torch.Tensor]
EXPORT_DIR = "hf_model"  # where a run's output folder holds the model in its ecosystem format (Task.export_pretrained)
SAMPLE_IDS = "sample_ids"  # every batch carries the global indices of its samples (for equivalence checks)


@dataclass
class StepOutput:
    """One micro-batch's result: the mean loss over the micro-batch, its size, and task metrics."""

    loss: torch.Tensor
    batch_size: int
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class ExportFacts:
    """What a model card states about the run that produced the weights (filled in by the trainer or monitor)."""

    run_id: str
    global_step: int  # global steps the weights have been through
    samples: int  # training samples behind those steps, swarm-wide
    exported_by: str  # e.g. "trainer peer-0 at the end of its run", "monitor on checkpoint 20"
    backend: str  # collaborative | single | ddp
    final_loss: Optional[float] = None  # training loss of the last recorded global step
    loss_step: Optional[int] = None  # the step final_loss is of; None: global_step - 1, the weights' last update
    metrics: Dict[str, float] = field(default_factory=dict)  # that step's task metrics (e.g. MLM accuracy)
    contributors: List[Dict[str, object]] = field(default_factory=list)  # {"peer", "samples", "steps"} rows


class Task(abc.ABC):
    """An experiment: a model, its optimizer/scheduler factories, an infinite batch stream and a loss.

    The optimizer and scheduler are *factories* because hivemind.Optimizer builds them itself (it may
    keep the optimizer on offloaded copies of the parameters). The scheduler is stepped once per
    **global** step by every backend, so schedules follow the swarm's progress, not local steps.
    """

    model: nn.Module
    # the clause a trainer's error line ends with when its input fingerprint differs from the run's
    input_mismatch_advice = "use the run's data settings"

    @abc.abstractmethod
    def make_optimizer(self, params: Iterable) -> torch.optim.Optimizer:
        """Optimizer over ``params`` (a list of tensors or param groups in the model's parameter order)."""

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> Optional[torch.optim.lr_scheduler.LRScheduler]:
        return None

    def optimizer_param_groups(self) -> list:
        """Param groups for the optimizer (e.g. no weight decay on biases/LayerNorm). Default: one group."""
        return [{"params": list(self.model.parameters())}]

    @abc.abstractmethod
    def batches(self, stream_seed: int) -> Iterator[Batch]:
        """An endless stream of micro-batches, ordered by ``stream_seed`` (each peer gets its own)."""

    def batch_plan(self, stream_seed: int):
        """``batches`` as a ``common.pipeline.PlannedBatches`` (a plan of sample ids + how to build one batch), so
        several worker processes can build it; None (the default): the stream runs whole in one worker."""
        return None

    def batch_stream(self, stream_seed: int, workers: int = 0, pin_memory: bool = False) -> Iterator[Batch]:
        """``batches``, built by ``workers`` DataLoader processes (0: on the calling thread); same batches either
        way."""
        if workers == 0:
            return self.batches(stream_seed)
        from common.pipeline import WholeStream, load_batches  # the pipeline module builds on this one

        planned = self.batch_plan(stream_seed)
        whole = WholeStream(lambda: self.batches(stream_seed))
        return load_batches(planned if planned is not None else whole, workers, pin_memory)

    def heldout_batches(self, count: int) -> Optional[List[Batch]]:
        """``count`` fixed micro-batches from data the task never trains on (a held-out split), for evaluation;
        None (the default) when the task keeps no such split."""
        return None

    @abc.abstractmethod
    def forward(self, model: nn.Module, batch: Batch) -> StepOutput:
        """Forward pass on one micro-batch (already on the model's device)."""

    def after_backward(self, model: nn.Module, global_step: int) -> None:
        """Hook between backward and the optimizer (e.g. SwAV zeroes prototype gradients early on)."""

    def on_global_step(self, model: nn.Module, global_step: int) -> None:
        """Hook after each completed global step (e.g. SwAV normalises prototypes)."""

    def input_fingerprint(self) -> str:
        """A short digest of what the model's inputs mean (a tokenizer's pieces in id order): trainers of one run
        must agree on it, as on the model's shape. "" (the default): nothing to compare, e.g. pixels."""
        return ""

    def export_pretrained(self, model: nn.Module, folder: Path, facts: ExportFacts) -> Optional[Path]:
        """Write ``model`` to ``folder`` in its ecosystem's format (weights, config, preprocessing files and a
        model card built from ``facts``); return the folder, or None when the task has no such format or the export
        failed (one ERROR line). Default: a ``transformers`` model as a Hugging Face folder with the task's
        ``tokenizer`` attribute, if any (``common.export``; override to change the card's text)."""
        from common.export import export_transformers_model  # the export module builds on this one

        return export_transformers_model(model, folder, facts, tokenizer=getattr(self, "tokenizer", None))


class DatasetTask(Task):
    """A task whose micro-batches all come from one dataset object: ``stream(stream_seed, batch_size)`` yields them
    in order, and a dataset that can plan ahead (``plan``/``batch``, see common.pipeline) lets worker processes build
    them. ``dataset`` is None on a peer that holds no data (monitor, auxiliary)."""

    dataset: Optional[object]
    local_batch_size: int

    def batches(self, stream_seed: int) -> Iterator[Batch]:
        if self.dataset is None:
            raise DataError(f"this {type(self).__name__} was built without data (monitor/auxiliary role)")
        return self.dataset.stream(stream_seed, self.local_batch_size)

    def batch_plan(self, stream_seed: int):
        from common.pipeline import planned_batches  # the pipeline module builds on this one

        return planned_batches(self.dataset, stream_seed, self.local_batch_size)
