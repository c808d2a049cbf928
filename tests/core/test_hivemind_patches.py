"""The patch layer over hivemind (common/hivemind_patches): one install per process, before any DHT starts; a patch
can be disabled to show the fault it fixes; and the regression tests of the fixes that have no file of their own.

Each fix's regression test fails with the fix left out: ``pytest tests/core/test_X.py --without-patch NAME`` (see
the patch table in common/README.md for which test belongs to which fix)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import time
from types import SimpleNamespace
from typing import AsyncIterator

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression.quantization import Quantization
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.servicer import ServicerBase
from hivemind.proto import averaging_pb2, dht_pb2

from common import hivemind_patches
from common.config import NetworkConfig
from common.dht import start_dht
from common.hivemind_patches.fixes import StreamCutShort, client_mode_argument, grad_buffers_for_scaler
from tests.leftovers import leaves_nothing_behind  # noqa: F401 (the fixture, for usefixtures)


class _Stop(Exception):
    pass


def test_every_peer_installs_the_patches_before_its_dht_starts(monkeypatch):
    def install():
        raise _Stop  # start_dht must not have started anything yet

    monkeypatch.setattr(hivemind_patches, "install", install)
    with pytest.raises(_Stop):
        start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))


def test_a_disabled_patch_gives_hivemind_its_own_code_back_and_is_applied_again_after():
    patched = Quantization.extract
    assert patched.__qualname__.startswith("read_8bit_tensors_with_numpy_2.")
    with hivemind_patches.disabled("read_8bit_tensors_with_numpy_2"):
        assert Quantization.extract.__qualname__ == "Quantization.extract"
        assert "without read_8bit_tensors_with_numpy_2" in hivemind_patches.software_fingerprint()
    assert Quantization.extract.__qualname__.startswith("read_8bit_tensors_with_numpy_2.")
    assert hivemind_patches.software_fingerprint().endswith(f"patch set {hivemind_patches.PATCH_SET_VERSION}")


def test_a_disabled_per_optimizer_fix_hands_hivemind_its_default_inside_the_block():
    client_dht = SimpleNamespace(client_mode=True)
    with hivemind_patches.disabled("client_mode_argument"):
        assert client_mode_argument(client_dht) is None  # hivemind.Optimizer's default
        assert hivemind_patches.software_fingerprint().endswith("without client_mode_argument")
    assert client_mode_argument(client_dht) is True


def test_disabling_a_log_policy_removes_its_filter_only_inside_the_block():
    import logging

    from common.hivemind_patches.policies import _GrouplessRound

    def groupless_filters():
        return [
            item
            for item in logging.getLogger("hivemind.averaging.averager").filters
            if isinstance(item, _GrouplessRound)
        ]

    assert len(groupless_filters()) == 1
    with hivemind_patches.disabled("log_groupless_rounds_as_warnings"):
        assert groupless_filters() == []
    assert len(groupless_filters()) == 1


def test_an_unknown_patch_name_is_refused():
    hivemind_patches.require_installed()
    with pytest.raises(ValueError, match="no such hivemind patch: deliver_streams"):
        saved, hivemind_patches._installed = hivemind_patches._installed, None
        try:
            hivemind_patches.install(without=["deliver_streams"])
        finally:
            hivemind_patches._installed = saved


def test_every_patch_is_a_fix_or_a_policy_and_says_when_to_remove_it():
    from common.hivemind_patches import fixes, policies, uploads

    for name, apply in {**hivemind_patches.PROCESS_WIDE, **hivemind_patches.PER_OPTIMIZER}.items():
        assert apply.__module__ in (fixes.__name__, policies.__name__, uploads.__name__), name
        assert (apply.__module__ == fixes.__name__) == (name in hivemind_patches.FIXES), name  # uploads: a policy
        if name in hivemind_patches.FIXES:
            doc = " ".join(apply.__doc__.split())
            assert "Upstream:" in doc and "Remove when" in doc, name


def test_a_servicer_subclass_calls_its_peers_under_the_name_it_registers():
    class Parent(ServicerBase):
        async def rpc_ping(self, request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse: ...

    class Child(Parent):
        pass

    Parent._collect_rpc_handlers()  # the parent first, as when a plain DecentralizedAverager ran in this process
    Child._collect_rpc_handlers()
    # hivemind registers a servicer's handlers under its own class name (_get_handle_name); its stub must call them
    # under the same one
    assert Child._stub_type.__name__ == "ChildStub" and Parent._stub_type.__name__ == "ParentStub"


def test_a_slow_full_peer_with_no_share_gets_results_while_it_sends():
    """The fix ``stream_results_to_zero_share_full_peers``: only client-mode peers are held back (hivemind 1.1.12
    holds back any peer with a share of 0). ``--without-patch stream_results_to_zero_share_full_peers`` fails it;
    tests/tools/test_zero_share_results.py measures the effect on emulated links."""
    fast, slow, client = (PeerID(bytes([0, 1, index])) for index in range(3))
    runner = object.__new__(AllReduceRunner)
    runner.ordered_peer_ids = (fast, slow, client)
    runner.peer_fractions = (1.0, 0.0, 0.0)
    runner.modes = (AveragingMode.NODE, AveragingMode.NODE, AveragingMode.CLIENT)
    assert runner.should_delay_results(client)
    assert not runner.should_delay_results(slow)
    assert not runner.should_delay_results(fast)


def test_the_identity_check_starts_its_daemon_with_the_callers_timeout(tmp_path):
    """The fix ``identity_check_uses_the_start_timeout`` (hivemind starts the checking daemon with its fixed 15 s).
    No daemon starts: the check's own ``create`` is intercepted. ``--without-patch
    identity_check_uses_the_start_timeout`` fails it."""
    identity = tmp_path / "identity.key"
    P2P.generate_identity(str(identity))
    peer_id = PeerID.from_identity(identity.read_bytes())
    calls = []

    class Probe(P2P):
        @classmethod
        async def create(cls, *args, **kwargs):
            calls.append(kwargs)
            if len(calls) > 1:  # the identity check's anonymous daemon
                raise _Stop
            return await super().create(*args, **kwargs)

    with pytest.raises(_Stop):
        asyncio.run(
            Probe.create(
                identity_path=str(identity),
                initial_peers=[f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id}"],
                startup_timeout=42.0,
            )
        )
    assert calls[1].get("startup_timeout") == 42.0


class _Discard:
    """A stream's writer whose bytes go nowhere."""

    def write(self, data):
        pass

    async def drain(self):
        pass

    def close(self):
        pass


def test_a_stream_broken_while_this_side_writes_is_cut_short():
    """The fix ``deliver_whole_streams``: when a server dies mid-stream, the caller's write of its end marker can
    hit the broken pipe before its read sees the end of the stream; asyncio then gives the reader that
    BrokenPipeError, which must read as a stream cut short as an early end does (this failed
    ``test_state_integrity.py::test_a_stream_whose_server_dies_mid_stream_raises_instead_of_ending`` once in the
    fast tier). No daemon: the stream is an asyncio reader holding that error. ``--without-patch
    deliver_whole_streams`` fails it (hivemind's reader raises the BrokenPipeError itself)."""

    async def call() -> None:
        reader = asyncio.StreamReader()
        reader.set_exception(BrokenPipeError(32, "Broken pipe"))

        class Caller:
            async def call_binary_stream_handler(self, peer_id, name):
                return None, reader, _Discard()

        async def no_requests():
            yield averaging_pb2.DownloadRequest()

        stream = await P2P._iterate_protobuf_stream_handler(
            Caller(), PeerID(b"server"), "handler", no_requests(), averaging_pb2.DownloadData
        )
        async for _ in stream:
            pass

    with pytest.raises(StreamCutShort, match="ended before its end marker"):
        asyncio.run(call())


def test_a_client_mode_peer_builds_its_optimizer_in_client_mode():
    """The fix ``client_mode_argument``: ``hivemind.Optimizer`` inverts its ``None`` check, so a client-mode DHT with
    ``client_mode`` left at its default gives a full peer. Nothing starts: the constructor is stopped right after it
    decided the mode. ``--without-patch client_mode_argument`` fails it."""
    decided = []

    class Probe(hivemind.Optimizer):
        def _make_progress_tracker(self, *args, **kwargs):
            decided.append(self.client_mode)
            raise _Stop

        def __del__(self):
            pass  # hivemind's would shut down averagers this probe never built

    client_dht = SimpleNamespace(client_mode=True)
    with pytest.raises(_Stop):
        Probe(
            dht=client_dht,
            run_id="client_mode",
            target_batch_size=4,
            batch_size_per_step=2,
            params=[torch.nn.Parameter(torch.zeros(2))],
            optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
            client_mode=client_mode_argument(client_dht),
        )
    assert decided == [True]


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_an_fp16_step_applies_the_unscaled_average_of_every_micro_batch():
    """The fix ``grad_buffers_for_scaler``: with hivemind's default separate accumulators, ``hivemind.GradScaler``
    unscales the model's ``.grad`` (the last micro-batch only), so the accumulated gradient is applied still
    multiplied by the loss scale. One peer, two micro-batches, SGD with lr 1: the step must be minus their mean
    gradient. ``--without-patch grad_buffers_for_scaler`` fails it (the step is 1024 times too large)."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    optimizer = None
    try:
        weight = torch.nn.Parameter(torch.zeros(2))
        optimizer = hivemind.Optimizer(
            dht=dht,
            run_id="grad_scaler",
            target_batch_size=4,
            batch_size_per_step=2,
            params=[weight],
            optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
            matchmaking_time=0.5,
            averaging_timeout=5,
            reuse_grad_buffers=grad_buffers_for_scaler(uses_grad_scaler=True, use_local_updates=False),
            client_mode=client_mode_argument(dht),
        )
        scaler = hivemind.GradScaler("cpu", init_scale=1024.0)
        for gradient in ([1.0, 2.0], [3.0, 4.0]):
            scaler.scale((weight * torch.tensor(gradient)).sum()).backward()
            optimizer.step(batch_size=2, grad_scaler=scaler)
            scaler.update()
            if not optimizer.grad_averager.reuse_grad_buffers:
                optimizer.zero_grad()  # the accumulators hold the sum; hivemind's own usage clears .grad
        assert optimizer.local_epoch == 1
        assert torch.equal(weight.detach(), torch.tensor([-2.0, -3.0]))
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


class _Pending(concurrent.futures.Future):
    """A DHT request that is never answered (a busy DHT process), awaitable as hivemind's MPFuture is."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class _SilentDHT:
    """Answers the tracker's first read (its constructor's) and no request after it."""

    client_mode = False
    peer_id = PeerID(b"silent")

    def __init__(self):
        self.requests = []

    def add_validators(self, validators):
        pass

    def get(self, key, latest=False, return_future=False):
        self.requests.append("get")
        return _Pending() if return_future else None

    def store(self, *args, return_future=False, **kwargs):
        self.requests.append("store")
        return _Pending()


@pytest.mark.timeout(30)
def test_a_progress_tracker_leaves_no_task_pending_when_it_shuts_down(caplog):
    """The fix ``finish_progress_tracker_tasks``: hivemind's tracker thread returns with its last DHT requests still
    pending in a loop it never closes; asyncio logs each as destroyed whenever that loop is collected. No process
    starts. ``--without-patch finish_progress_tracker_tasks`` fails it."""
    dht = _SilentDHT()
    tracker = ProgressTracker(dht, "leaks", 4, min_refresh_period=0.01, default_refresh_period=0.01, start=True)
    tracker.report_local_progress(local_epoch=0, samples_accumulated=2)
    deadline = time.monotonic() + 10
    while dht.requests.count("get") < 2 or "store" not in dht.requests:  # a fetch and a report under way
        assert time.monotonic() < deadline, dht.requests
        time.sleep(0.01)
    tracker.shutdown(timeout=10)
    tracker.join(timeout=10)
    assert not tracker.is_alive()
    del tracker
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


class _Averager(DecentralizedAverager):
    """One class for the donor and the receiver: a peer asks for the handlers of its own class's name."""

    corrupt = False  # the donor flips one byte of the first tensor part it sends

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        flipped = not self.corrupt
        async for message in super().rpc_download_state(request, context):
            if not flipped and message.tensor_part.buffer:
                buffer = bytearray(message.tensor_part.buffer)
                buffer[len(buffer) // 2] ^= 1
                message.tensor_part.buffer, flipped = bytes(buffer), True
            yield message


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_state_download_corrupted_in_transit_is_refused():
    """The fix ``verify_state_downloads``: hivemind 1.1.12 loads whatever arrives (here one flipped byte of the
    right size). ``--without-patch verify_state_downloads`` fails it."""
    state = torch.arange(4096, dtype=torch.float32)
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(a) for a in first.get_visible_maddrs()], start=True
    )
    averagers = []
    try:
        donor = _Averager([state.clone()], dht=first, prefix="corrupt_download", target_group_size=2, start=False)
        donor.corrupt = True  # before its process is forked
        donor.run_in_background(await_ready=True)
        averagers.append(donor)
        receiver = _Averager(
            [torch.zeros(4096)], dht=second, prefix="corrupt_download", target_group_size=2, start=True
        )
        averagers.append(receiver)
        deadline = time.monotonic() + 30
        while not second.get("corrupt_download.all_averagers", latest=True) and time.monotonic() < deadline:
            time.sleep(0.2)  # the donor declares that it shares state
        loaded = receiver.load_state_from_peers(timeout=10)
        assert loaded is None  # refused (hivemind returns the corrupt state: (metadata, [tensor]))
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
