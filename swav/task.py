"""SwAV self-supervised pretraining as a task for the one training loop.

Loss: lightly's ``SwaVLoss`` (swapped prediction, Sinkhorn-Knopp codes; the codes come from every large crop,
i.e. crops [0, 1] with the paper's two). Optimizer: timm's ``Lars`` (SGD + LARC). Schedule, prototype
freezing and the feature queue follow the **global** step the loop reports through the task hooks.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional

import torch
from lightly.loss import SwaVLoss
from timm.optim import Lars

from common.checkpoints import read_state_file
from common.config import RunConfig, require
from common.errors import ConfigError
from common.task import Batch, DatasetTask, ExportFacts, StepOutput
from swav.data import FASHION_MNIST, FASHION_MNIST_DIR, MultiCropDataset, MultiCropSpec, crop_key, open_images
from swav.model import RESNET50, SMALL_RESNET, SwavModel, build_trunk

logger = logging.getLogger(__name__)
EXPORT_TRUNK_FILE = "trunk.pt"
EXPORT_MODEL_FILE = "swav_model.pt"


@dataclass
class TaskConfig:
    # data: 'fashion_mnist' (Debian package) or an ImageFolder root (ImageNet layout)
    dataset: str = FASHION_MNIST
    fashion_mnist_dir: str = FASHION_MNIST_DIR
    max_images: Optional[int] = None
    data_seed: int = 0
    # multi-crop: the first group are the large crops whose codes are predicted
    crop_sizes: List[int] = field(default_factory=lambda: [224, 96])
    crop_counts: List[int] = field(default_factory=lambda: [2, 6])
    crop_min_scales: List[float] = field(default_factory=lambda: [0.14, 0.05])
    crop_max_scales: List[float] = field(default_factory=lambda: [1.0, 0.14])
    flip_probability: float = 0.5
    color_jitter_strength: float = 1.0
    blur_probability: float = 0.5
    # model
    arch: str = RESNET50  # resnet50 | small_resnet
    small_widths: List[int] = field(default_factory=lambda: [16, 32, 64, 128])
    small_blocks: List[int] = field(default_factory=lambda: [1, 1, 1, 1])
    head_hidden_dim: int = 2048
    head_output_dim: int = 128
    num_prototypes: int = 3000
    freeze_prototypes_steps: int = 5005  # global steps with zero prototype gradient
    # loss
    temperature: float = 0.1
    sinkhorn_iterations: int = 3
    sinkhorn_epsilon: float = 0.03
    queue_length: int = 3840  # per peer; 0 disables the queue
    queue_start_step: int = 0  # global step at which the queue starts filling (used once full)
    # optimizer: SGD + LARC, lr warmup from warmup_start_lr to base_lr, then cosine to final_lr
    base_lr: float = 2.4
    warmup_start_lr: float = 0.3
    final_lr: float = 0.0048
    warmup_steps: int = 0
    total_steps: int = 1000
    momentum: float = 0.9
    weight_decay: float = 1e-6
    lars_trust: float = 0.001

    def __post_init__(self) -> None:
        require(bool(self.dataset), "task.dataset must be 'fashion_mnist' or an ImageFolder root")
        require(self.max_images is None or self.max_images > 0, "task.max_images must be > 0")
        groups = len(self.crop_sizes)
        require(groups >= 1, "task.crop_sizes must list at least one crop size")
        require(
            len(self.crop_counts) == groups
            and len(self.crop_min_scales) == groups
            and len(self.crop_max_scales) == groups,
            "task.crop_sizes, crop_counts, crop_min_scales and crop_max_scales must have the same length",
        )
        require(all(size > 0 for size in self.crop_sizes), "task.crop_sizes must be > 0")
        require(self.crop_counts[0] >= 2, "task.crop_counts[0] must be >= 2 (two large crops swap predictions)")
        require(all(count >= 1 for count in self.crop_counts), "task.crop_counts must be >= 1")
        require(
            all(0 < low <= high <= 1 for low, high in zip(self.crop_min_scales, self.crop_max_scales)),
            "task.crop_min_scales/crop_max_scales must satisfy 0 < min <= max <= 1",
        )
        for name in ("flip_probability", "blur_probability"):
            require(0 <= getattr(self, name) <= 1, f"task.{name} must be in [0, 1]")
        require(self.color_jitter_strength >= 0, "task.color_jitter_strength must be >= 0")
        require(
            self.arch in (RESNET50, SMALL_RESNET),
            f"task.arch must be {RESNET50} or {SMALL_RESNET} (got {self.arch!r})",
        )
        require(
            len(self.small_widths) == 4 and all(width > 0 and width % 2 == 0 for width in self.small_widths),
            "task.small_widths must be four positive even stage widths",
        )
        require(
            len(self.small_blocks) == 4 and all(blocks >= 1 for blocks in self.small_blocks),
            "task.small_blocks must be four block counts >= 1",
        )
        require(
            self.head_hidden_dim > 0 and self.head_output_dim > 0, "task.head_hidden_dim/head_output_dim must be > 0"
        )
        require(self.num_prototypes >= 2, "task.num_prototypes must be >= 2")
        require(self.freeze_prototypes_steps >= 0, "task.freeze_prototypes_steps must be >= 0")
        require(self.temperature > 0, "task.temperature must be > 0")
        require(self.sinkhorn_iterations >= 1, "task.sinkhorn_iterations must be >= 1")
        require(self.sinkhorn_epsilon > 0, "task.sinkhorn_epsilon must be > 0")
        require(self.queue_length >= 0, "task.queue_length must be >= 0")
        require(self.queue_start_step >= 0, "task.queue_start_step must be >= 0")
        require(
            self.base_lr > 0 and self.warmup_start_lr >= 0 and self.final_lr >= 0,
            "task.base_lr must be > 0 and task.warmup_start_lr, task.final_lr >= 0",
        )
        require(
            self.warmup_steps >= 0 and self.total_steps > self.warmup_steps,
            "task.total_steps must exceed task.warmup_steps >= 0",
        )
        require(0 <= self.momentum < 1, "task.momentum must be in [0, 1)")
        require(self.weight_decay >= 0, "task.weight_decay must be >= 0")
        require(self.lars_trust > 0, "task.lars_trust must be > 0")

    @property
    def crops(self) -> MultiCropSpec:
        return MultiCropSpec(
            self.crop_sizes,
            self.crop_counts,
            self.crop_min_scales,
            self.crop_max_scales,
            self.flip_probability,
            self.color_jitter_strength,
            self.blur_probability,
        )


def learning_rate(step: int, config: TaskConfig) -> float:
    """SwAV's schedule: linear warmup from ``warmup_start_lr`` to ``base_lr``, then cosine to ``final_lr``."""
    if step < config.warmup_steps:
        return config.warmup_start_lr + (config.base_lr - config.warmup_start_lr) * step / config.warmup_steps
    decay_steps = config.total_steps - config.warmup_steps
    progress = min(step - config.warmup_steps, decay_steps) / decay_steps
    return config.final_lr + 0.5 * (config.base_lr - config.final_lr) * (1 + math.cos(math.pi * progress))


class FeatureQueue:
    """Embeddings of the large crops from earlier micro-batches on this peer, newest first.

    Sinkhorn on a small micro-batch gives poor equipartition; the queue adds ``length`` recent embeddings
    (scored with the *current* prototypes) to each assignment problem. Used only once full, as in SwAV.
    """

    def __init__(self, num_assignment_crops: int, length: int, dim: int, device: torch.device):
        self.embeddings = torch.zeros(num_assignment_crops, length, dim, device=device)
        self.filled = 0

    @property
    def full(self) -> bool:
        return self.filled >= self.embeddings.shape[1]

    def scores(self, prototypes: torch.Tensor) -> List[torch.Tensor]:
        return [queue @ prototypes.detach().t() for queue in self.embeddings.float()]

    @torch.no_grad()
    def push(self, crop_embeddings: List[torch.Tensor]) -> None:
        length = self.embeddings.shape[1]
        for index, embeddings in enumerate(crop_embeddings):
            self.embeddings[index] = torch.cat([embeddings.detach().float(), self.embeddings[index]])[:length]
        self.filled = min(length, self.filled + len(crop_embeddings[0]))


class SwavTask(DatasetTask):
    def __init__(self, config: TaskConfig, local_batch_size: int, dataset: Optional[MultiCropDataset]):
        self.config, self.local_batch_size, self.dataset = config, local_batch_size, dataset
        self.model = SwavModel(
            config.arch,
            config.small_widths,
            config.small_blocks,
            config.head_hidden_dim,
            config.head_output_dim,
            config.num_prototypes,
        )
        self.loss_fn = SwaVLoss(
            temperature=config.temperature,
            sinkhorn_iterations=config.sinkhorn_iterations,
            sinkhorn_epsilon=config.sinkhorn_epsilon,
        )
        self.num_crops, self.num_large_crops = sum(config.crop_counts), config.crop_counts[0]
        self.global_step = 0
        self.queue: Optional[FeatureQueue] = None

    def make_optimizer(self, params: Iterable) -> torch.optim.Optimizer:
        # timm's Lars with trust_clip=False and always_adapt=True is apex's LARC(clip=False) around SGD, which
        # the SwAV code uses: weight decay is added to the gradient, then every tensor's update is scaled by
        # trust * |w| / (|g| + wd |w|) before SGD momentum.
        return Lars(
            params,
            lr=self.config.base_lr,
            momentum=self.config.momentum,
            weight_decay=self.config.weight_decay,
            trust_coeff=self.config.lars_trust,
            trust_clip=False,
            always_adapt=True,
        )

    def make_scheduler(self, optimizer: torch.optim.Optimizer):
        base_lr = self.config.base_lr
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(step, self.config) / base_lr)

    def forward(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        crops = [batch[crop_key(index)] for index in range(self.num_crops)]
        batch_size = int(crops[0].shape[0])
        embeddings, scores = model(crops)
        crop_scores = scores.float().split(batch_size)
        queue_scores = None
        if self.queue is not None and self.queue.full:
            queue_scores = self.queue.scores(model.prototypes.weight.float())
        loss = self.loss_fn(
            list(crop_scores[: self.num_large_crops]), list(crop_scores[self.num_large_crops :]), queue_scores
        ).reshape(())
        if self.queue is not None:
            self.queue.push(list(embeddings.split(batch_size)[: self.num_large_crops]))
        return StepOutput(loss=loss, batch_size=batch_size, metrics={"queue_used": float(queue_scores is not None)})

    def _observe_global_step(self, model: torch.nn.Module, global_step: int) -> None:
        self.global_step = global_step
        if self.queue is None and self.config.queue_length > 0 and global_step >= self.config.queue_start_step:
            weight = model.prototypes.weight
            self.queue = FeatureQueue(self.num_large_crops, self.config.queue_length, weight.shape[1], weight.device)
            logger.info(f"feature queue of {self.config.queue_length} switched on at global step {global_step}")

    def after_backward(self, model: torch.nn.Module, global_step: int) -> None:
        self._observe_global_step(model, global_step)
        if global_step < self.config.freeze_prototypes_steps:
            for param in model.prototypes.parameters():
                if param.grad is not None:
                    param.grad.zero_()

    def on_global_step(self, model: torch.nn.Module, global_step: int) -> None:
        model.prototypes.normalize()
        self._observe_global_step(model, global_step)

    def export_pretrained(self, model: torch.nn.Module, folder: Path, facts: ExportFacts) -> Optional[Path]:
        """The trunk as SwAV releases it (a ResNet state dict without classifier, BatchNorm statistics included:
        ``trunk.pt``), the whole model with head and prototypes (``swav_model.pt``) and a card; written beside the
        folder and swapped in, so a reader never sees half of it."""
        folder = Path(folder)
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        torch.save(model.trunk.state_dict(), staging / EXPORT_TRUNK_FILE)
        torch.save(model.state_dict(), staging / EXPORT_MODEL_FILE)
        loss = "n/a" if facts.final_loss is None else f"{facts.final_loss:.4f}"
        (staging / "README.md").write_text(
            f"# SwAV {self.config.arch} ({facts.run_id})\n\n"
            f"Self-supervised SwAV pretraining, {facts.backend} backend: global step {facts.global_step}, "
            f"{facts.samples} samples, training loss {loss}; exported by {facts.exported_by}.\n\n"
            f"`{EXPORT_TRUNK_FILE}`: the trunk's state dict (no classifier; BatchNorm running statistics averaged "
            f"across the swarm). `{EXPORT_MODEL_FILE}`: trunk, projection head and {self.config.num_prototypes} "
            "prototypes. Reload with `swav.task.load_exported_trunk(folder, config.task)`.\n"
        )
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        return folder


def load_exported_trunk(folder: Path, config: TaskConfig) -> torch.nn.Module:
    """A freshly built trunk of the configured architecture with an exported ``trunk.pt`` loaded (strictly)."""
    trunk, _ = build_trunk(config.arch, config.small_widths, config.small_blocks)
    trunk.load_state_dict(read_state_file(Path(folder) / EXPORT_TRUNK_FILE, weights_only=True))
    return trunk


def build_task(run_config: RunConfig, with_data: bool = True) -> SwavTask:
    config: TaskConfig = run_config.task
    if run_config.training.local_batch_size < 2:
        raise ConfigError("training.local_batch_size must be >= 2 for SwAV (BatchNorm and Sinkhorn need a batch)")
    if not with_data:
        return SwavTask(config, run_config.training.local_batch_size, None)
    images = open_images(config.dataset, config.fashion_mnist_dir, config.max_images)
    logger.info(f"SwAV data: {len(images)} images from {config.dataset}, {sum(config.crop_counts)} crops each")
    return SwavTask(
        config, run_config.training.local_batch_size, MultiCropDataset(images, config.crops, config.data_seed)
    )
