"""SwAV data: real images (Fashion-MNIST from Debian, or an ImageNet-layout ImageFolder) -> multi-crop views.

Augmentations are lightly's ``SwaVTransform`` (random resized crops per resolution, flip, colour distortion,
grey-scale, Gaussian blur, normalisation). Each sample's views depend only on (data seed, sample id, pass), so
two runs that see the same samples see the same crops, whichever peer draws them.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
from lightly.transforms.swav_transform import SwaVTransform
from PIL import Image

from common.errors import DataError
from common.seeding import stable_seed
from common.task import SAMPLE_IDS, Batch

logger = logging.getLogger(__name__)

FASHION_MNIST = "fashion_mnist"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
IDX_IMAGES_MAGIC = 2051  # unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC = 2049  # unsigned bytes, 1 dimension


def crop_key(index: int) -> str:
    return f"crop_{index}"


def _read_idx(path: Path, magic: int, header_bytes: int) -> Tuple[np.ndarray, Tuple[int, ...]]:
    try:
        with gzip.open(path, "rb") as stream:
            raw = stream.read()
    except FileNotFoundError:
        raise DataError(
            f"Fashion-MNIST file {path} is missing: install the Debian package "
            f"'{FASHION_MNIST_PACKAGE}' (apt-get install -y {FASHION_MNIST_PACKAGE})"
        ) from None
    except (OSError, EOFError) as error:
        raise DataError(f"cannot read IDX file {path}: {error}") from None
    header = np.frombuffer(raw[:header_bytes], dtype=">u4")
    if len(header) == 0 or int(header[0]) != magic:
        raise DataError(f"{path} is not an IDX file with magic number {magic}")
    shape = tuple(int(size) for size in header[1:])
    data = np.frombuffer(raw[header_bytes:], dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: header says shape {shape} but the file holds {data.size} bytes of data")
    return data.reshape(shape), shape


def load_fashion_mnist(split: str, root: str = FASHION_MNIST_DIR) -> Tuple[np.ndarray, np.ndarray]:
    """``split`` = train (60,000) or t10k (10,000): uint8 images [N, 28, 28] and int64 labels [N]."""
    if split not in ("train", "t10k"):
        raise DataError(f"Fashion-MNIST split must be train or t10k (got {split!r})")
    images, _ = _read_idx(Path(root) / f"{split}-images-idx3-ubyte.gz", IDX_IMAGES_MAGIC, 16)
    labels, _ = _read_idx(Path(root) / f"{split}-labels-idx1-ubyte.gz", IDX_LABELS_MAGIC, 8)
    if len(images) != len(labels):
        raise DataError(f"Fashion-MNIST {split}: {len(images)} images but {len(labels)} labels")
    return images, labels.astype(np.int64)


class ImageSource(Protocol):
    def __len__(self) -> int: ...

    def image(self, index: int) -> Image.Image:
        """The sample's image as an RGB PIL image."""


class ArrayImages:
    """Greyscale uint8 images [N, H, W] repeated to three channels."""

    def __init__(self, images: np.ndarray):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def image(self, index: int) -> Image.Image:
        return Image.fromarray(self.images[index], mode="L").convert("RGB")


class FolderImages:
    """An ImageFolder root (ImageNet layout: ``root/<class>/<image>``); labels are ignored for pretraining.

    A file that does not decode (truncated, corrupt, not an image) is skipped with one WARNING line naming it: its
    sample is replaced by the next readable image, so micro-batches keep their size and every peer that draws the
    sample gets the same substitute. A folder in which no image decodes is a DataError.
    """

    def __init__(self, root: str):
        from torchvision.datasets import ImageFolder

        if not Path(root).is_dir():
            raise DataError(
                f"image folder {root!r} does not exist (task.dataset must be '{FASHION_MNIST}' "
                "or an ImageFolder root such as /data/imagenet/train)"
            )
        try:
            self.folder = ImageFolder(root)
        except (FileNotFoundError, RuntimeError) as error:
            raise DataError(f"{root!r} is not an ImageFolder root: {error}") from None
        self.unreadable: set = set()  # paths found not to decode (per process: each loader worker finds its own)

    def __len__(self) -> int:
        return len(self.folder)

    def image(self, index: int) -> Image.Image:
        count = len(self.folder.samples)
        for offset in range(count):
            path, _ = self.folder.samples[(index + offset) % count]
            if path in self.unreadable:
                continue
            try:
                image = self.folder.loader(path)
                return image.convert("RGB")
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
                self.unreadable.add(path)  # PIL's decoders raise all of these for broken files
                logger.warning(f"skipping image {path}: it does not decode ({type(error).__name__}: {error})")
        raise DataError(f"no image in {self.folder.root!r} decodes")


def open_images(dataset: str, fashion_mnist_dir: str, max_images: Optional[int]) -> ImageSource:
    if dataset == FASHION_MNIST:
        images, _ = load_fashion_mnist("train", fashion_mnist_dir)
        source: ImageSource = ArrayImages(images if max_images is None else images[:max_images])
    else:
        source = FolderImages(dataset)
        if max_images is not None and max_images < len(source):
            source.folder.samples = source.folder.samples[:max_images]
    if len(source) == 0:
        raise DataError(f"dataset {dataset!r} holds no images")
    return source


@dataclass(frozen=True)
class MultiCropSpec:
    crop_sizes: Sequence[int]
    crop_counts: Sequence[int]
    crop_min_scales: Sequence[float]
    crop_max_scales: Sequence[float]
    flip_probability: float
    color_jitter_strength: float
    blur_probability: float

    @property
    def num_crops(self) -> int:
        return int(sum(self.crop_counts))

    def transform(self) -> SwaVTransform:
        return SwaVTransform(
            crop_sizes=tuple(self.crop_sizes),
            crop_counts=tuple(self.crop_counts),
            crop_min_scales=tuple(self.crop_min_scales),
            crop_max_scales=tuple(self.crop_max_scales),
            hf_prob=self.flip_probability,
            cj_strength=self.color_jitter_strength,
            gaussian_blur=self.blur_probability,
        )


@contextlib.contextmanager
def seeded_global_rngs(seed: int):
    """torchvision draws from torch's global RNG and lightly's blur from numpy's and Python's: seed all three for
    one sample, then give the caller back its own RNG states."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class MultiCropDataset:
    """Images -> SwAV views; ``stream`` yields endless equal-size micro-batches with ``sample_ids``."""

    def __init__(self, images: ImageSource, spec: MultiCropSpec, seed: int):
        self.images, self.spec, self.seed = images, spec, seed
        self.transform = spec.transform()

    def __len__(self) -> int:
        return len(self.images)

    def views(self, sample_id: int, pass_index: int) -> List[torch.Tensor]:
        with seeded_global_rngs(stable_seed(self.seed, "views", sample_id, pass_index)):
            return self.transform(self.images.image(sample_id))

    def batch(self, sample_ids: Sequence[int], pass_index: int) -> Batch:
        per_sample = [self.views(sample_id, pass_index) for sample_id in sample_ids]
        batch: Batch = {
            crop_key(index): torch.stack([views[index] for views in per_sample])
            for index in range(self.spec.num_crops)
        }
        batch[SAMPLE_IDS] = torch.as_tensor(list(sample_ids), dtype=torch.long)
        batch["pass_index"] = torch.tensor(pass_index)
        return batch

    def plan(self, stream_seed: int, batch_size: int) -> Iterator[Tuple[List[int], int]]:
        """Endless (sample ids, pass), reshuffled every pass by ``stream_seed``; only full micro-batches (BatchNorm
        needs several samples)."""
        if batch_size > len(self):
            raise DataError(f"micro-batch of {batch_size} exceeds the {len(self)} images available")
        pass_index = 0
        while True:
            generator = torch.Generator().manual_seed(stable_seed(stream_seed, "order", pass_index))
            order = torch.randperm(len(self), generator=generator)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                yield order[start : start + batch_size].tolist(), pass_index
            pass_index += 1

    def stream(self, stream_seed: int, batch_size: int) -> Iterator[Batch]:
        """Endless micro-batches, in ``plan``'s order (``common.pipeline`` builds them in worker processes)."""
        for ids, pass_index in self.plan(stream_seed, batch_size):
            yield self.batch(ids, pass_index)
