"""Mixed precision, decided once per process (``common.context.RunContext``): the autocast dtype, and whether
gradients need a loss scaler.

* ``fp32``: no autocast, no scaler.
* ``bf16``: autocast to bfloat16. bfloat16 keeps float32's 8-bit exponent, so gradients underflow and overflow
  no more than in fp32: no loss scaling and no skipped steps. ``auto`` picks it on GPUs that support it.
* ``fp16``: autocast to float16 with dynamic loss scaling. float16's smallest normal number is about 6e-5 and
  small gradients (ALBERT-large's are) flush to zero without scaling: the loss is multiplied by a scale
  (2^16 at first) before backward and the gradients divided by it before the optimizer. A non-finite scaled
  gradient halves the scale and its gradients are skipped; every 2000 clean global steps double it.
* ``auto``: bf16 on a CUDA GPU that supports it, fp16 on an older CUDA GPU, fp32 on a CPU.

Where an fp16 step is skipped depends on the backend (each follows its library's rule):

* single and DDP (torch / accelerate): the scaler checks the gradients of the whole global batch (on DDP after
  the all-reduce, so every worker sees the same values) and skips the global step; every worker alike.
* collaborative (``hivemind.GradScaler``): a peer checks each micro-batch's scaled gradients; an overflow
  discards the gradients this peer accumulated for the step in progress and halves its scale, and the swarm's
  step goes on with everyone else's samples. A global step whose *averaged* gradients are not finite is skipped
  by every peer alike (they all receive the same average: see ``hivemind_compat.skip_nonfinite_steps``).
"""

from __future__ import annotations

import enum
import logging

import torch

from common.errors import ConfigError

logger = logging.getLogger(__name__)


def check_device(device: torch.device) -> None:
    """A CUDA device this machine does not have is a one-line error before any tensor goes there."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "training.device=cuda but this machine has no usable CUDA GPU (torch.cuda.is_available() is false): "
            "set training.device=auto (the CPU here) or cpu"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")


class Precision(enum.StrEnum):
    """A resolved precision (never ``auto``), with what follows from it: the autocast dtype and the scaler policy."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @property
    def loss_scaling(self) -> bool:
        """The scaler policy: fp16 gradients need dynamic loss scaling (each backend uses its library's scaler)."""
        return self is Precision.fp16

    def autocast(self, device: torch.device):
        """The forward pass's autocast context (a disabled one for fp32)."""
        dtype = {Precision.fp16: torch.float16, Precision.bf16: torch.bfloat16}.get(self)
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def resolve_precision(requested: str, device: torch.device, fp16_on_cpu: bool = False) -> Precision:
    """``requested`` (a config value) -> fp32, fp16 or bf16 for this device; fp16 without a GPU, bf16 on a GPU
    without bfloat16 and a CUDA device that is not there are errors."""
    check_device(device)
    if requested == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"training.precision=bf16 needs a GPU with bfloat16 support and {torch.cuda.get_device_name(device)} "
            "has none: set training.precision=auto (fp16 with loss scaling there) or fp16"
        )
    if requested == "auto":
        if device.type == "cuda":
            chosen = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            chosen = "fp32"
        logger.info(f"training.precision=auto: {chosen} on {device.type}")
        return Precision(chosen)
    if requested == "fp16" and device.type != "cuda" and not fp16_on_cpu:
        raise ConfigError(
            f"training.precision=fp16 needs a CUDA GPU and this run uses {device.type}: "
            f"set training.precision=auto (fp32 here) or fp32"
        )
    return Precision(requested)
