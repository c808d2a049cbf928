"""What goes on the wire: every compression a config can name reads back as the tensor it was sent as."""

import pytest
import torch
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from common.config import Compression
from common.hivemind_compat import read_8bit_tensors_with_numpy_2
from common.optimizer import make_compression

# relative L2 error of one round trip: fp16 rounds to ~1e-3 relative, 256 levels to a few percent
TOLERANCE = {"none": 0.0, "fp16": 1e-3, "scaled_fp16": 1e-3, "uniform8bit": 0.05}


@pytest.mark.parametrize("kind", sorted(TOLERANCE))
def test_configured_compression_reads_back(kind):
    read_8bit_tensors_with_numpy_2()  # installed by make_collaborative_optimizer on every peer
    compression = make_compression(Compression(kind))
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, compression.compression_type))
    assert restored.shape == tensor.shape and restored.dtype == tensor.dtype
    assert float((restored - tensor).norm() / tensor.norm()) <= TOLERANCE[kind]


def test_quantile_8bit_reads_back():
    read_8bit_tensors_with_numpy_2()
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    restored = deserialize_torch_tensor(serialize_torch_tensor(tensor, CompressionType.QUANTILE_8BIT))
    assert float((restored - tensor).norm() / tensor.norm()) < 0.05
