"""State downloads are verified (common.state_integrity, the fix ``verify_state_downloads``) and a p2p stream cut
short is an error, not a complete stream (the fix ``deliver_whole_streams``); both installed by tests/conftest.py."""

import asyncio

import pytest
import torch
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from common.hivemind_compat import StreamCutShort
from common.state_integrity import STATE_DIGEST_KEY, served_state, state_problem, with_digests, without_digests


def state():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4000, 64, generator=generator), torch.randn(128, generator=generator), torch.zeros(3)]


def on_the_wire(tensors, compression=None):
    """What a receiver assembles: each tensor serialized as the donor's averager sends it, split and recombined."""
    compression = compression or NoCompression()
    assembled = []
    for index, tensor in enumerate(tensors):
        serialized = compression.compress(tensor, CompressionInfo.from_tensor(tensor, key=index), allow_inplace=False)
        assembled.append(combine_from_streaming(list(split_for_streaming(serialized))))
    return assembled


def serve(tensors, previous=None, epoch=7, compression=None):
    metadata = dict(epoch=epoch)
    return served_state(previous, repr(metadata).encode(), metadata, tensors, None, compression or NoCompression())


@pytest.mark.parametrize("compression", [NoCompression(), Float16Compression()])
def test_what_the_donor_serves_passes_the_receivers_check(compression):
    served = serve(state(), compression=compression)
    metadata = with_digests(dict(epoch=7), served.digests)
    assert state_problem(metadata, on_the_wire(served.tensors, compression)) is None
    assert without_digests(metadata) == dict(epoch=7)


def test_a_right_sized_tensor_with_one_wrong_byte_is_refused():
    served = serve(state())
    assembled = on_the_wire(served.tensors)
    buffer = bytearray(assembled[0].buffer)
    buffer[len(buffer) // 2] ^= 1
    assembled[0].buffer = bytes(buffer)
    problem = state_problem(with_digests({}, served.digests), assembled)
    assert problem == "tensor 0 of 3 (shape [4000, 64], 1024000 bytes) does not match its digest"


def test_a_missing_tensor_a_cut_tensor_and_a_state_without_digests_are_refused():
    served = serve(state())
    metadata = with_digests({}, served.digests)
    assembled = on_the_wire(served.tensors)
    assert state_problem(metadata, assembled[:2]) == "2 tensors arrived where the donor's digests list 3"
    parts = list(split_for_streaming(assembled[0]))
    cut = [combine_from_streaming(parts[: len(parts) // 2]), *assembled[1:]]  # what hivemind's reader assembled
    assert "tensor 0 of 3" in state_problem(metadata, cut)
    assert "without digests" in state_problem({"epoch": 7}, assembled)
    assert "without digests" in state_problem({STATE_DIGEST_KEY: "not a list"}, assembled)


def test_the_donor_hashes_once_per_step_and_serves_a_snapshot():
    tensors = state()
    first = serve(tensors)
    assert serve(tensors, previous=first) is first  # the same step and tensors: no second snapshot or hash
    tensors[1].add_(1.0)  # an in-place update (an optimizer step) within the step
    second = serve(tensors, previous=first)
    assert second is not first and second.digests[1] != first.digests[1] and second.digests[0] == first.digests[0]
    assert serve(tensors, previous=second, epoch=8) is not second  # a new step
    before = second.tensors[1].clone()
    tensors[1].add_(1.0)
    assert torch.equal(second.tensors[1], before)  # what is served never changes under the digests


def test_a_state_without_a_step_is_hashed_per_request():
    tensors = state()
    metadata = dict(group_key="x")
    first = served_state(None, b"m", metadata, tensors, None, NoCompression())
    assert served_state(first, b"m", metadata, tensors, None, NoCompression()) is not first


HANDLER = "cut_short_test"


@pytest.mark.timeout(120)
def test_a_stream_whose_server_dies_mid_stream_raises_instead_of_ending():
    """The cause of issue 46: hivemind reads a stream that stops without its end marker as complete."""

    async def dies_after_three(_stream_info, _reader, writer):
        for index in range(3):
            await P2P.send_protobuf(runtime_pb2.ExpertResponse(metadata=b"%d" % index), writer)
        writer.close()  # as the serving process's connection to its daemon closes when the process dies

    async def talk():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        caller = None
        try:
            caller = await P2P.create(initial_peers=await server.get_visible_maddrs())
            await server.add_binary_stream_handler(HANDLER, dies_after_three)
            stream = await caller.iterate_protobuf_handler(
                server.peer_id, HANDLER, runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
            )
            received = []
            with pytest.raises(StreamCutShort, match="ended before its end marker"):
                async for response in stream:
                    received.append(response.metadata)
            return received
        finally:
            if caller is not None:
                await caller.shutdown()
            await server.shutdown()

    # a dying server's daemon resets the stream, which may drop responses still in flight: what arrived is a prefix
    # of what was sent, and the caller is told the stream was cut rather than given it as complete
    received = asyncio.run(talk())
    assert received == [b"0", b"1", b"2"][: len(received)]
