"""The run context: what a process resolves once from its config (device, precision and its scaler policy, seed)
and passes to the components that need it, which never derive it from the config again.

Config sections say what was asked (``training.device=auto``, ``training.precision=auto``); the context says what
this process got on this machine (``cuda:0``, ``bf16``). A trainer builds it in ``common.roles.trainer.run_trainer``;
the monitor and auxiliary peers build no model on an accelerator and need none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from common.config import RunConfig
from common.precision import Precision, resolve_precision
from common.seeding import stable_seed


def resolve_device(requested: str) -> torch.device:
    """``training.device`` -> the device: ``auto`` is the CUDA GPU if this machine has one, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


@dataclass(frozen=True)
class RunContext:
    device: torch.device
    precision: Precision  # resolved: its loss_scaling is the scaler policy every backend follows
    seed: int  # training.seed: the initial parameters; each peer's data order derives from it (stream_seed)

    @classmethod
    def resolve(cls, config: RunConfig, device: Optional[torch.device] = None) -> "RunContext":
        """Resolve ``config.training``'s device (unless ``device`` is given), precision and seed; a device or
        precision this machine cannot run is a one-line ``ConfigError``."""
        device = device if device is not None else resolve_device(config.training.device)
        precision = resolve_precision(config.training.precision, device, config.debug.fp16_on_cpu)
        return cls(device=device, precision=precision, seed=config.training.seed)

    def seed_parameters(self) -> None:
        """Every peer starts from the same initial parameters: seed torch before the task builds its model."""
        torch.manual_seed(self.seed)

    def stream_seed(self, key: str) -> int:
        """The seed of the data stream of the process ``key`` names (its peer id, name or DDP worker)."""
        return stable_seed(self.seed, key)
