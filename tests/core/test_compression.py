"""What goes on the wire: every compression a config accepts reads back as the tensor it was sent as, and one it
cannot run here is refused at load. The 8-bit codecs read back only with the fix ``read_8bit_tensors_with_numpy_2``
(installed by tests/conftest.py; ``pytest --without-patch read_8bit_tensors_with_numpy_2`` fails them)."""

import importlib.util

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from common.config import Compression, load_config
from common.errors import ConfigError
from common.optimizer import make_compression
from tests.helpers import ROOT

# relative L2 error of one round trip: fp16 rounds to ~1e-3 relative, 256 levels to a few percent
TOLERANCE = {"none": 0.0, "fp16": 1e-3, "scaled_fp16": 1e-3, "uniform8bit": 0.05, "blockwise8bit": 0.05}
HAS_BITSANDBYTES = importlib.util.find_spec("bitsandbytes") is not None
TINY = str(ROOT / "configs/albert/tiny.yaml")


def runs_here(kind: Compression) -> bool:
    return kind != Compression.blockwise8bit or HAS_BITSANDBYTES


def test_every_codec_the_config_names_has_a_tolerance_here():
    assert sorted(TOLERANCE) == sorted(kind.value for kind in Compression)


@pytest.mark.parametrize("kind", list(Compression), ids=lambda kind: kind.value)
def test_configured_compression_reads_back_or_is_refused_at_load(kind):
    override = f"collaboration.compression={kind.value}"
    if not runs_here(kind):
        with pytest.raises(ConfigError, match=f"compression={kind.value} needs the bitsandbytes package"):
            load_config(TINY, [override])
        return
    assert load_config(TINY, [override]).collaboration.compression == kind
    compression = make_compression(kind)
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))
    assert restored.shape == tensor.shape and restored.dtype == tensor.dtype
    assert float((restored - tensor).norm() / tensor.norm()) <= TOLERANCE[kind.value]


def test_quantile_8bit_reads_back():
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, CompressionType.QUANTILE_8BIT))
    assert float((restored - tensor).norm() / tensor.norm()) < 0.05
