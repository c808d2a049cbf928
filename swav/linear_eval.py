"""Linear evaluation (the paper's metric) and kNN accuracy of frozen SwAV trunk features on Fashion-MNIST.

Features: the trunk's global-average-pooled output in eval mode, on whole images resized to the large-crop
size and normalised like the training crops. Linear probe: multinomial logistic regression (L2 1e-4) on
standardised train features; kNN: cosine similarity, k nearest train features vote with weight exp(sim / T).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from lightly.transforms.utils import IMAGENET_NORMALIZE

from common.checkpoints import read_state_file
from common.config import RunConfig, import_task_module
from common.errors import DataError
from swav.data import load_fashion_mnist
from swav.model import SwavModel

logger = logging.getLogger(__name__)

KNN_TEMPERATURE = 0.07  # vote weight exp(cosine / T), as in the instance-discrimination kNN monitor


@dataclass
class EvalResult:
    linear_top1: float
    knn_top1: float
    train_images: int
    test_images: int
    feature_dim: int
    seconds: float


@torch.no_grad()
def extract_features(model: SwavModel, images: np.ndarray, image_size: int, batch_size: int = 500) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_NORMALIZE["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_NORMALIZE["std"]).view(1, 3, 1, 1)
    was_training = model.training
    model.eval()
    features = []
    started, last_log = time.time(), time.time()
    try:
        for start in range(0, len(images), batch_size):
            chunk = (
                torch.tensor(images[start : start + batch_size]).float().div(255).unsqueeze(1).expand(-1, 3, -1, -1)
            )
            if chunk.shape[-1] != image_size:
                chunk = F.interpolate(chunk, size=(image_size, image_size), mode="bilinear", align_corners=False)
            features.append(model.features((chunk - mean) / std).float())
            if time.time() - last_log > 15:
                last_log = time.time()
                done = start + len(chunk)
                eta = (time.time() - started) / done * (len(images) - done)
                logger.info(f"features: {done}/{len(images)} images | ETA {eta:.0f} s")
    finally:
        model.train(was_training)
    return torch.cat(features)


def linear_probe_top1(
    train: torch.Tensor,
    train_labels: np.ndarray,
    test: torch.Tensor,
    test_labels: np.ndarray,
    num_classes: int = 10,
    weight_decay: float = 1e-4,
    iterations: int = 200,
) -> float:
    """Multinomial logistic regression on standardised features, fitted to convergence with full-batch L-BFGS.

    torch rather than scikit-learn's LogisticRegression: the same model, but sklearn took minutes per fit on
    this shared 2-core machine, while L-BFGS over a 10,000 x 128 matrix takes about a second.
    """
    mean, std = train.mean(dim=0), train.std(dim=0).clamp_min(1e-6)
    train_x, test_x = (train - mean) / std, (test - mean) / std
    targets = torch.from_numpy(train_labels)
    classifier = torch.nn.Linear(train_x.shape[1], num_classes)
    torch.nn.init.zeros_(classifier.weight)  # the problem is convex: a fixed start makes the fit deterministic
    torch.nn.init.zeros_(classifier.bias)
    optimizer = torch.optim.LBFGS(
        classifier.parameters(), lr=1.0, max_iter=iterations, history_size=20, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(classifier(train_x), targets) + weight_decay * classifier.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        predictions = classifier(test_x).argmax(dim=1).numpy()
    return float((predictions == test_labels).mean())


def knn_top1(
    train: torch.Tensor,
    train_labels: np.ndarray,
    test: torch.Tensor,
    test_labels: np.ndarray,
    k: int = 20,
    num_classes: int = 10,
    chunk: int = 1000,
) -> float:
    train = F.normalize(train, dim=1)
    labels = torch.from_numpy(train_labels)
    correct = 0
    for start in range(0, len(test), chunk):
        similarity = F.normalize(test[start : start + chunk], dim=1) @ train.t()
        top_similarity, top_index = similarity.topk(k, dim=1)
        votes = torch.zeros(len(top_index), num_classes)
        votes.scatter_add_(1, labels[top_index], (top_similarity / KNN_TEMPERATURE).exp())
        correct += int((votes.argmax(1).numpy() == test_labels[start : start + chunk]).sum())
    return correct / len(test)


def evaluate(
    model: SwavModel,
    image_size: int,
    fashion_mnist_dir: str,
    max_train: Optional[int],
    max_test: Optional[int],
    knn_k: int = 20,
) -> EvalResult:
    """Top-1 of a linear probe and of kNN on frozen features: train on (a prefix of) train, test on t10k."""
    started = time.time()
    train_images, train_labels = load_fashion_mnist("train", fashion_mnist_dir)
    test_images, test_labels = load_fashion_mnist("t10k", fashion_mnist_dir)
    train_images, train_labels = train_images[:max_train], train_labels[:max_train]
    test_images, test_labels = test_images[:max_test], test_labels[:max_test]
    train = extract_features(model, train_images, image_size)
    test = extract_features(model, test_images, image_size)
    return EvalResult(
        linear_top1=linear_probe_top1(train, train_labels, test, test_labels),
        knn_top1=knn_top1(train, train_labels, test, test_labels, k=knn_k),
        train_images=len(train_images),
        test_images=len(test_images),
        feature_dim=int(train.shape[1]),
        seconds=time.time() - started,
    )


def load_model(config: RunConfig, state_path: Optional[str]) -> SwavModel:
    """The configured model with a trainer's ``final_model.pt`` loaded, or its seeded random initialisation."""
    torch.manual_seed(config.training.seed)  # the same initial parameters the trainers start from
    model = import_task_module(config.task_module).build_task(config, with_data=False).model
    if state_path is not None:
        state = read_state_file(Path(state_path))
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0]
            raise DataError(f"{state_path} does not fit the configured SwAV model: {first_line}") from None
    return model


def large_crop_size(crop_sizes: Sequence[int]) -> int:
    return int(crop_sizes[0])
