"""SwAV network: ResNet trunk -> projection head (lightly's SwaVProjectionHead) -> L2 normalise -> prototypes."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from lightly.models.modules.heads import SwaVProjectionHead
from timm.models.resnet import BasicBlock, ResNet
from torch import nn
from torchvision.models import resnet50

RESNET50 = "resnet50"
SMALL_RESNET = "small_resnet"


def build_trunk(arch: str, small_widths: Sequence[int], small_blocks: Sequence[int]) -> Tuple[nn.Module, int]:
    """The feature extractor (global-average-pooled, no classifier) and its feature width."""
    if arch == RESNET50:
        trunk = resnet50(weights=None)  # SwAV trains from scratch; nothing is downloaded
        width = trunk.fc.in_features
        trunk.fc = nn.Identity()
        return trunk, width
    if arch == SMALL_RESNET:
        # timm's ResNet takes any stage widths; the 3x3 stride-1 stem without max-pool (the usual CIFAR-size
        # adaptation) keeps spatial detail in 16-32 px crops that a 7x7 stride-2 stem + pool would discard.
        # A 'deep' stem is requested only because it sizes the stem output (2 x stem_width) from the config
        # instead of timm's fixed 64; the stem itself is then replaced.
        trunk = ResNet(
            BasicBlock,
            list(small_blocks),
            num_classes=0,
            stem_type="deep",
            stem_width=small_widths[0] // 2,
            channels=tuple(small_widths),
        )
        trunk.conv1 = nn.Conv2d(3, small_widths[0], kernel_size=3, stride=1, padding=1, bias=False)
        trunk.maxpool = nn.Identity()
        return trunk, int(small_widths[-1])
    raise ValueError(f"unknown trunk architecture {arch!r}")


class Prototypes(nn.Module):
    """SwAV prototypes: a bias-free linear layer whose rows are kept on the unit sphere.

    Not lightly's ``SwaVPrototypes``: its linear layer has a bias (the paper's has none, so scores are cosine
    similarities), and its freezing toggles ``requires_grad``, which an optimizer built once over a fixed
    parameter list (hivemind.Optimizer, the single backend) never sees; freezing is done by zeroing the
    gradient in ``SwavTask.after_backward`` instead.
    """

    def __init__(self, dim: int, count: int):
        super().__init__()
        self.layer = nn.Linear(dim, count, bias=False)
        self.normalize()

    @torch.no_grad()
    def normalize(self) -> None:
        self.layer.weight.copy_(F.normalize(self.layer.weight, dim=1, p=2))

    @property
    def weight(self) -> torch.Tensor:
        """The unit-norm prototypes the scores use."""
        return F.normalize(self.layer.weight, dim=1, p=2)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        # Normalised on the fly as well as in place after each global step: hivemind.Optimizer steps offloaded
        # copies of the parameters and writes them back, which undoes an in-place normalisation; scores from
        # unit vectors stay in [-1, 1], so Sinkhorn's exp(score / 0.03) cannot overflow.
        return F.linear(embeddings, self.weight)


class SwavModel(nn.Module):
    def __init__(
        self,
        arch: str,
        small_widths: Sequence[int],
        small_blocks: Sequence[int],
        hidden_dim: int,
        output_dim: int,
        num_prototypes: int,
    ):
        super().__init__()
        self.trunk, self.feature_dim = build_trunk(arch, small_widths, small_blocks)
        self.projection_head = SwaVProjectionHead(self.feature_dim, hidden_dim, output_dim)
        self.prototypes = Prototypes(output_dim, num_prototypes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Trunk features (what linear evaluation reads)."""
        return self.trunk(images)

    def embed(self, crops: List[torch.Tensor]) -> torch.Tensor:
        """Unit-norm embeddings of every crop, in crop order [sum of batch sizes, output_dim].

        Crops of equal resolution go through the trunk together (as in the SwAV code), so BatchNorm statistics
        are taken over all views of one resolution; the head then sees every crop at once.
        """
        features, start = [], 0
        while start < len(crops):
            end = start
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            features.append(self.trunk(torch.cat(crops[start:end])))
            start = end
        return F.normalize(self.projection_head(torch.cat(features)), dim=1, p=2)

    def forward(self, crops: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.embed(crops)
        return embeddings, self.prototypes(embeddings)
