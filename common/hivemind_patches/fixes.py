"""Bug fixes: hivemind 1.1.12 behaviour that is wrong whatever a project wants from it.

Each function either is a process-wide patch taking a :class:`Patcher` (installed by
``common.hivemind_patches.install``, before the DHT and averager processes are forked, which inherit it) or adapts
one ``hivemind.Optimizer`` (called by ``common.optimizer.make_collaborative_optimizer``). Each docstring says what
is wrong, whether hivemind's master fixes it, and when to remove the patch; the regression tests named in
``common/README.md``'s patch table fail with the patch disabled.

"Upstream" was read from hivemind's master at 4bd43b7 (2026-01-05, the newest commit; version 1.2.0.dev0) for
issue 40: every file these fixes replace code of is byte-identical to 1.1.12's there except ``p2p_daemon.py`` (only
how it finds the p2pd binary differs) and ``quantization.py`` (the numpy-2 fix). No upstream issue or pull request
was found for any fault below unless one is named.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
import types
from contextlib import closing, suppress
from typing import Optional

import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from common.hivemind_patches.patcher import Patcher

logger = logging.getLogger(__name__)

# The per-optimizer fixes in force in this process. ``install`` puts each in force like a process-wide patch, so
# that ``--without-patch NAME`` and ``hivemind_patches.disabled`` leave one out: it then hands hivemind its default.
_per_optimizer_in_force = set()


def put_in_force(name: str, patcher: Patcher) -> None:
    _per_optimizer_in_force.add(name)
    patcher.on_undo(lambda: _per_optimizer_in_force.discard(name))


def _in_force(name: str) -> bool:
    from common import hivemind_patches  # the package imports this module

    hivemind_patches.require_installed()
    return name in _per_optimizer_in_force


def skip_nonfinite_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step`` a no-op (with a warning) when any gradient is NaN/Inf.

    Fixes: a partial all-reduce can hand every peer of a round the same non-finite average (hivemind divides a part
    by the total weight it received, 0 when only zero-weight peers got through), which the optimizer would apply.
    Skipped as an AMP grad scaler skips, every peer's parameters stay finite and identical.
    Upstream: unchanged on master (``TensorPartReducer`` divides by the weight it received, unchecked). Per
    optimizer (``make_collaborative_optimizer``).
    Remove when the all-reduce never divides by a zero weight.
    """
    if not _in_force("skip_nonfinite_steps"):
        return optimizer
    take_step = optimizer.step

    def guarded_step(self, *args, **kwargs):
        gradients = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not all(bool(torch.isfinite(gradient).all()) for gradient in gradients):
            logger.warning("the averaged gradient is not finite (a partial averaging round): optimizer step skipped")
            return None
        return take_step(*args, **kwargs)

    # a bound method, as torch's LR schedulers expect when they wrap optimizer.step
    optimizer.step = types.MethodType(guarded_step, optimizer)
    return optimizer


def client_mode_argument(dht: hivemind.DHT) -> Optional[bool]:
    """The ``client_mode`` to pass to ``hivemind.Optimizer`` explicitly.

    Fixes: ``Optimizer.__init__`` inverts its ``None`` check (``client_mode if client_mode is None else
    dht.client_mode``), so left at its default a client-mode trainer runs as a full peer and crashes at its first
    epoch (state sharing on a client averager). Upstream: still inverted on master (``optimizer.py`` line 205).
    Remove when fixed there.
    """
    return dht.client_mode if _in_force("client_mode_argument") else None


def grad_buffers_for_scaler(uses_grad_scaler: bool, use_local_updates: bool) -> bool:
    """The ``reuse_grad_buffers`` to give ``hivemind.Optimizer``: True whenever a
    ``hivemind.GradScaler`` is used with gradient averaging.

    Fixes: before averaging, hivemind unscales the gradients in the model's ``.grad`` buffers; with its default
    separate accumulators those hold only the last micro-batch, so the accumulated gradients are averaged and
    applied still multiplied by the loss scale. With ``reuse_grad_buffers`` the ``.grad`` buffers are the
    accumulators. hivemind forbids it with local updates, which unscale every micro-batch anyway.
    Upstream: unchanged on master; ``hivemind.GradScaler``'s docstring says it is made for
    ``reuse_grad_buffers=True``, but nothing enforces it. Remove when ``GradScaler`` unscales the accumulators.
    """
    if not _in_force("grad_buffers_for_scaler"):
        return False  # hivemind's default
    return uses_grad_scaler and not use_local_updates


STATE_DOWNLOAD_FAILED = "Failed to download state from "  # hivemind's own log line, which a policy rewrites


STREAM_LINGER_SECONDS = 30.0


class StreamCutShort(P2PHandlerError):
    """A p2p stream that ended without its end marker (:func:`deliver_whole_streams`): what arrived
    is incomplete. A ``P2PHandlerError``, so that hivemind's matchmaking and all-reduce treat it as a failed peer."""


def deliver_whole_streams(patcher: Patcher) -> None:
    """End every p2p stream with an end marker, and close a served stream only once its
    caller has read it all.

    Fixes two faults of hivemind 1.1.12's protobuf streams. (1) A handler closes its stream right after its last
    response; the serving daemon then resets the stream, and the reset makes the caller's daemon drop what it has
    received but not yet passed on, so a caller that reads a little late loses the tail ("peer ... sent 22 parts,
    but we expected 25"). (2) A stream that ends early (the server died) reads as complete, so a state download
    from a donor killed mid-transfer assembles a truncated tensor. Here the handler sends hivemind's own
    end-of-stream marker after its last response and waits (at most ``STREAM_LINGER_SECONDS``) for the caller to
    close; the caller stops at the marker, and a stream without it raises :class:`StreamCutShort`. Errors carry a
    non-empty message so that none reads as the marker. WIRE CHANGE: a caller without this patch takes the marker
    for an error, so both sides must run it (``PATCH_SET_VERSION``). Upstream: unchanged on master. Remove when
    hivemind's streams end with a marker and linger, or the daemon stops dropping data on reset.
    """
    from hivemind.p2p.p2p_daemon import P2P, P2PContext
    from hivemind.proto.p2pd_pb2 import RPCError

    async def wait_until_closed(reader, pending_read):
        with suppress(Exception):  # closing may also break the connection
            await pending_read
            while await reader.read(2**16):
                pass  # requests the finished handler did not read

    async def add_protobuf_stream_handler(self, name, handler, input_protobuf_type, max_prefetch=5, balanced=False):
        async def handle_stream(stream_info, reader, writer):
            context = P2PContext(handle_name=name, local_id=self.peer_id, remote_id=stream_info.peer_id)
            requests = asyncio.Queue(max_prefetch)

            async def read_requests():
                while (request := await requests.get()) is not None:
                    yield request

            async def send(response) -> bool:
                try:
                    await P2P.send_protobuf(response, writer)
                    return True
                except Exception:
                    return False  # the caller has closed (a matchmaking follower, once it knows its group)

            async def process_requests():
                try:
                    async for response in handler(read_requests(), context):
                        if not await send(response):
                            return
                    await send(P2P.END_OF_STREAM)
                except Exception as error:
                    logger.warning("p2p stream handler %s failed: %r", name, error)
                    await send(RPCError(message=str(error) or repr(error)))

            with closing(writer):
                processing = asyncio.create_task(process_requests())
                receiving = None
                try:
                    while True:
                        receiving = asyncio.create_task(P2P.receive_protobuf(input_protobuf_type, reader))
                        await asyncio.wait({processing, receiving}, return_when=asyncio.FIRST_COMPLETED)
                        if not receiving.done():  # the handler is done: the caller closes once it has read it all
                            with suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(wait_until_closed(reader, receiving), STREAM_LINGER_SECONDS)
                            return
                        try:
                            request, _ = await receiving
                        except (asyncio.IncompleteReadError, ConnectionError):  # the caller closed (or died)
                            return
                        if not processing.done():
                            await requests.put(request)  # None for the caller's end-of-stream marker
                except Exception as error:
                    logger.warning("p2p stream handler %s: reading the requests failed: %r", name, error)
                finally:
                    if receiving is not None:
                        receiving.cancel()
                    processing.cancel()

        await self.add_binary_stream_handler(name, handle_stream, balanced=balanced)

    async def iterate_protobuf_stream_handler(self, peer_id, name, requests, output_protobuf_type):
        _, reader, writer = await self.call_binary_stream_handler(peer_id, name)

        async def write_requests():
            async for request in requests:
                await P2P.send_protobuf(request, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        async def read_responses():
            with closing(writer):
                try:
                    while True:
                        try:
                            response, error = await P2P.receive_protobuf(output_protobuf_type, reader)
                        except (asyncio.IncompleteReadError, ConnectionError):
                            # a broken connection reaches the reader as the error of whichever side hit it first: a
                            # BrokenPipeError when our end marker's write did (asyncio sets it on the reader too)
                            raise StreamCutShort(
                                f"the stream of handler `{name}` at {peer_id} ended before its end marker: the peer "
                                "stopped or its connection broke mid-stream"
                            ) from None
                        if error == P2P.END_OF_STREAM:
                            break
                        if error is not None:
                            raise P2PHandlerError(f"Failed to call handler `{name}` at {peer_id}: {error.message}")
                        yield response
                finally:
                    writing.cancel()  # a finished handler reads no more requests
                    await asyncio.gather(writing, return_exceptions=True)

        writing = asyncio.create_task(write_requests())
        return read_responses()

    patcher.replace(P2P, "_add_protobuf_stream_handler", add_protobuf_stream_handler)
    patcher.replace(P2P, "_iterate_protobuf_stream_handler", iterate_protobuf_stream_handler)


def verify_state_downloads(patcher: Patcher) -> None:
    """Serve every state download with per-tensor digests, and use a downloaded state only
    if it matches them.

    Fixes: a state download carries no checksum, so a receiver loads whatever it assembled (a corrupt or truncated
    state). The donor's serving thread (hivemind's own, in the host process) adds BLAKE2b digests of a snapshot to
    the state's metadata (``common.state_integrity``); the receiver's ``_load_state_from_peers`` is hivemind's loop
    with the check before it deserializes: a mismatch, a state without digests or a stream cut short is one WARNING
    line and the next peer is asked. WIRE CHANGE: a receiver without this patch sees an extra metadata key, and a
    state from a peer without it is refused (``PATCH_SET_VERSION``). Upstream: no state checksum on master. Remove
    when hivemind verifies downloads.
    """
    from hivemind.averaging import averager as averager_module
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import aiter_with_timeout
    from hivemind.utils.streaming import combine_from_streaming
    from hivemind.utils.timed_storage import ValueWithExpiration

    from common import state_integrity

    averager_logger = logging.getLogger("hivemind.averaging.averager")

    def _background_thread_fetch_current_state(serializer, pipe, get_current_state_ref):
        """hivemind's thread (host process), serving a snapshot of the state with its digests."""
        served = None
        while True:
            try:
                trigger, future = pipe.recv()
            except BaseException as error:
                averager_logger.debug(f"Averager background thread finished: {error!r}")
                break
            if trigger == "_SHUTDOWN":
                break
            try:
                get_current_state = get_current_state_ref()
                if get_current_state is None:
                    break
                averager = get_current_state.__self__
                state = tuple(get_current_state())
                del get_current_state
                metadata, tensors, infos = state + (None,) * (3 - len(state))
                with averager.lock_averaged_tensors:
                    served = state_integrity.served_state(
                        served, serializer.dumps(metadata), metadata, tensors, infos, averager.state_compression
                    )
                del averager, tensors
                metadata = serializer.dumps(state_integrity.with_digests(metadata, served.digests))
                future.set_result((metadata, served.tensors, infos))
            except BaseException as error:
                future.set_exception(error)
                averager_logger.warning(f"could not serve this peer's state: {error!r}")

    async def _load_state_from_peers(self, future, timeout=None):
        """hivemind 1.1.12's download loop; the state is checked against its digests before it is used."""
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            peer_priority, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            peer_priority = {
                PeerID(peer_id): (float(info.value), random.random())  # randomness breaks ties
                for peer_id, info in peer_priority.items()
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
            }
            if not peer_priority:
                averager_logger.info(f"Averager could not load state from peers: peer dict empty {peer_priority}")
                return
            for peer in sorted(peer_priority.keys(), key=peer_priority.get, reverse=True):
                if peer == self.peer_id:
                    continue
                started = time.monotonic()
                averager_logger.info(f"Downloading parameters from peer {peer}")
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata, serialized, parts = None, [], []
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # the first part of the next tensor
                            serialized.append(combine_from_streaming(parts))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        serialized.append(combine_from_streaming(parts))
                    if not metadata:
                        averager_logger.debug(f"Peer {peer} did not send its state")
                        continue
                    problem = state_integrity.state_problem(metadata, serialized)
                    if problem is not None:
                        averager_logger.warning(
                            f"state downloaded from peer {peer} not used: {problem}; asking the next peer"
                        )
                        continue
                    tensors = [deserialize_torch_tensor(tensor) for tensor in serialized]
                    averager_logger.info(
                        f"Finished downloading state in {time.monotonic() - started:.3f}s from {peer} (verified)"
                    )
                    future.set_result((state_integrity.without_digests(metadata), tensors))
                    return
                except StreamCutShort as error:
                    averager_logger.warning(f"state download from peer {peer} not used: {error}; asking the next peer")
                except Exception as error:
                    averager_logger.exception(f"{STATE_DOWNLOAD_FAILED}{peer} - {error!r}")
        finally:
            if not future.done():
                future.set_result(None)

    patcher.replace(averager_module, "_background_thread_fetch_current_state", _background_thread_fetch_current_state)
    patcher.replace(DecentralizedAverager, "_load_state_from_peers", _load_state_from_peers)


def keep_inbound_stream_handlers_alive(patcher: Patcher) -> None:
    """Hold a strong reference to every task that serves an inbound p2p stream
    until it ends.

    Fixes: asyncio keeps only weak references to tasks; ``ControlClient._handler`` serving an inbound stream (an
    all-reduce part, a state download) while its socket's reading is paused is referred to by nothing outside a
    reference cycle, and a garbage collection destroys it mid-transfer ("Task was destroyed but it is pending!"):
    the peer at the other end sees its stream reset. Upstream: unchanged on master. Remove when the control client
    keeps its handler tasks.
    """
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    serve_stream = ControlClient._handler

    async def serve_stream_kept_alive(self, reader, writer):
        running = self.__dict__.setdefault("_running_stream_handlers", set())
        task = asyncio.current_task()
        running.add(task)
        try:
            await serve_stream(self, reader, writer)
        finally:
            running.discard(task)

    patcher.replace(ControlClient, "_handler", serve_stream_kept_alive)


def close_averager_p2p_on_shutdown(patcher: Patcher) -> None:
    """Close an averager process's own p2p client when the averager shuts down.

    Fixes: ``DecentralizedAverager._shutdown`` never shuts down the averager's replica of the DHT's ``P2P``, and the
    process ends without finalizers, so its Unix socket ``/tmp/hivemind-p2pclient-<id>.sock`` stays behind (two per
    trainer per run). The replica has no daemon of its own, so closing it touches nothing the DHT process uses.
    Upstream: unchanged on master. Remove when the averager closes its replica.
    """
    from hivemind.averaging.averager import DecentralizedAverager

    shutdown = DecentralizedAverager._shutdown

    async def shutdown_and_close_p2p(self, timeout):
        try:
            await shutdown(self, timeout)
        finally:
            replica = getattr(self, "_p2p", None)
            if replica is not None:
                await replica.shutdown()

    patcher.replace(DecentralizedAverager, "_shutdown", shutdown_and_close_p2p)


def finish_abandoned_executor_maps(patcher: Patcher) -> None:
    """Keep the task that feeds an all-reduce's executor map alive until the map is
    closed.

    Fixes: ``amap_in_executor`` (serializing tensor parts in the all-reduce) starts a producer task and cancels it
    in its ``finally``. When a stream is dropped mid-transfer, the generator, its blocked producer and their queue
    refer only to each other; the garbage collector finalizes the producer while still pending ("Task was destroyed
    but it is pending!", plus "Future exception was never retrieved" for what it queued). Here each producer is
    kept in a set until done, and closing the map retrieves whatever it queued. Upstream: unchanged on master
    (learning-at-home/hivemind#427, in 1.1.12, fixed the producer of a map that ran to its end, not this).
    Remove when ``amap_in_executor`` holds its producer.
    """
    from hivemind.averaging import allreduce, partition
    from hivemind.utils.asyncio import azip

    running_producers = set()

    async def amap_in_executor(func, *iterables, max_prefetch: int = 1, executor=None):
        loop = asyncio.get_running_loop()
        results = asyncio.Queue(max_prefetch)

        async def produce():
            try:
                async for args in azip(*iterables):
                    await results.put(loop.run_in_executor(executor, func, *args))
                await results.put(None)
            except Exception as error:
                failed = loop.create_future()
                failed.set_exception(error)
                await results.put(failed)

        producer = asyncio.create_task(produce())
        running_producers.add(producer)
        producer.add_done_callback(running_producers.discard)
        try:
            result = await results.get()
            while result is not None:
                yield await result
                result = await results.get()
        finally:
            producer.cancel()
            # a stream read that breaks as it is cancelled raises the stream's error instead, which the producer
            # queues as it ends: drain until it has ended, retrieving every queued failure
            while not (producer.done() and results.empty()):
                queued = [results.get_nowait() for _ in range(results.qsize())]
                unfinished = [producer, *(item for item in queued if item is not None)]
                for awaitable in unfinished:
                    awaitable.cancel()
                await asyncio.gather(*unfinished, return_exceptions=True)

    patcher.replace(partition, "amap_in_executor", amap_in_executor)
    patcher.replace(allreduce, "amap_in_executor", amap_in_executor)


def stream_results_to_zero_share_full_peers(patcher: Patcher) -> None:
    """Hold back the all-reduce results of client-mode peers only, not of
    every peer with a share of 0.

    Fixes: hivemind 1.1.12 sends a peer whose share is 0 its averaged parts only after that peer has sent its whole
    vector (``AllReduceRunner.should_delay_results``, meant for client-mode peers, which the averager never
    declares to the runner). The load balancer gives a share of 0 to *slow full peers* too, assuming their upload
    and download overlap; held back, they upload and then download, and balancing gains nothing. Here the runner
    gets the modes the peers declared in matchmaking. Upstream: unchanged on master. Remove when the runner is told
    the peers' modes. Same messages on the wire; only when results are sent changes.
    """
    from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
    from hivemind.averaging.averager import DecentralizedAverager

    run_allreduce = DecentralizedAverager._run_allreduce_inplace_

    async def with_declared_modes(self, tensors, group_info, group_id=None, **kwargs):
        if "modes" not in kwargs:  # each peer's gathered metadata is (bandwidth, mode, user data)
            declared = [self.serializer.loads(metadata)[1] for metadata in group_info.gathered]
            kwargs["modes"] = tuple(map(AveragingMode, declared))
        return await run_allreduce(self, tensors, group_info, group_id, **kwargs)

    def holds_back_client_mode_peers(self, peer_id) -> bool:
        return self.modes[self.ordered_peer_ids.index(peer_id)] == AveragingMode.CLIENT

    patcher.replace(DecentralizedAverager, "_run_allreduce_inplace_", with_declared_modes)
    patcher.replace(AllReduceRunner, "should_delay_results", holds_back_client_mode_peers)


def _header_int(buffer: bytes, offset: int = 0) -> int:
    return int(np.frombuffer(buffer, offset=offset, count=1, dtype=np.int64)[0])


def read_8bit_tensors_with_numpy_2(patcher: Patcher) -> None:
    """Read 8-bit quantized tensors back under numpy 2, exactly as hivemind writes
    them.

    Fixes: hivemind 1.1.12 parses the codebook size with ``int(np.frombuffer(..., count=1))``, an error in numpy 2:
    every reducer fails to read every part, and ``uniform8bit`` / ``blockwise8bit`` rounds end with partial
    averages or time out. Same layout and arithmetic, header read with an index. Upstream: fixed on master by
    learning-at-home/hivemind#670 (4bd43b7, ``.item()``), not in a release yet. Remove when the pinned release has
    it.
    """
    from hivemind.compression.quantization import (
        _BLOCKWISE_QUANTIZATION_BLOCKSIZE,
        BlockwiseQuantization,
        Quantization,
    )

    def extract(self, serialized_tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook = np.frombuffer(buffer, offset=8, count=_header_int(buffer), dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    def extract_blockwise(self, serialized_tensor) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise  # hivemind's own requirement for this codec

        buffer = serialized_tensor.buffer
        absmax = np.frombuffer(buffer, offset=16, count=_header_int(buffer), dtype=self.codebook_dtype)
        codebook_offset = 16 + absmax.nbytes
        codebook = np.frombuffer(
            buffer, offset=codebook_offset, count=_header_int(buffer, 8), dtype=self.codebook_dtype
        )
        quantized = np.frombuffer(buffer, offset=codebook_offset + codebook.nbytes, dtype=self.indices_dtype)
        result = dequantize_blockwise(
            torch.as_tensor(quantized).reshape(tuple(serialized_tensor.size)),
            absmax=torch.as_tensor(absmax),
            code=torch.as_tensor(codebook),
            blocksize=_BLOCKWISE_QUANTIZATION_BLOCKSIZE,
            nested=False,
        )
        return result.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)

    patcher.replace(Quantization, "extract", extract)
    patcher.replace(BlockwiseQuantization, "extract", extract_blockwise)


DETACH_FROM_SENDER = "detach_from_sender"  # the wrapper's name: a policy's log filter knows its frames by it


def report_vanished_handle_senders(patcher: Patcher) -> None:
    """Report a pipe handle whose sender exited mid-handoff as ``ConnectionResetError``, not ``EOFError``.

    Fixes: every hivemind process talks to the DHT process through one pipe; a request's reply pipe travels as a
    handle that the DHT process fetches from the *sender's* ``multiprocessing`` resource sharer. When the sender (an
    averager shutting down) exits mid-handoff, the fetch ends in ``EOFError``, which ``DHT.run`` does not catch
    (it catches connection errors): the DHT process dies with a traceback. Reported as the connection error it is,
    ``DHT.run`` logs it and goes on serving. Patches the standard library's ``resource_sharer.DupFd.detach``.
    Upstream: unchanged on master. Remove when ``DHT.run`` survives any error of one request.
    """
    from multiprocessing import resource_sharer

    detach = resource_sharer.DupFd.detach

    def detach_from_sender(self):
        try:
            return detach(self)
        except EOFError as error:
            raise ConnectionResetError("the process that sent this handle has exited") from error

    patcher.replace(resource_sharer.DupFd, "detach", detach_from_sender)


# the ``startup_timeout`` of the ``P2P.create`` call being run, for the identity check it makes
_START_TIMEOUT = contextvars.ContextVar("p2p_startup_timeout", default=15.0)


def identity_check_uses_the_start_timeout(patcher: Patcher) -> None:
    """Start the p2p daemon that checks whether a peer's identity is in use with the caller's ``startup_timeout``.

    Fixes: ``P2P.create`` checks that an existing identity is free by starting a second, anonymous daemon, and
    starts that one with the fixed default of 15 s whatever ``startup_timeout`` it was given: on a busy machine the
    check alone failed restarts ("Daemon failed to start in 15.0 seconds") although
    ``network.daemon_start_timeout`` was 60 s. Upstream: unchanged on master. Remove when
    ``is_identity_taken`` receives the timeout.
    """
    from hivemind.p2p.p2p_daemon import P2P

    create = vars(P2P)["create"].__func__

    async def create_with_its_timeout_known(cls, *args, startup_timeout: float = 15.0, **kwargs):
        token = _START_TIMEOUT.set(startup_timeout)
        try:
            return await create(cls, *args, startup_timeout=startup_timeout, **kwargs)
        finally:
            _START_TIMEOUT.reset(token)

    async def is_identity_taken(cls, identity_path, *, initial_peers, tls, use_auto_relay, use_ipfs, use_relay):
        from hivemind.p2p import PeerID

        with open(identity_path, "rb") as handle:
            peer_id = PeerID.from_identity(handle.read())
        anonymous_p2p = await cls.create(
            initial_peers=initial_peers,
            dht_mode="client",
            tls=tls,
            use_auto_relay=use_auto_relay,
            use_ipfs=use_ipfs,
            use_relay=use_relay,
            startup_timeout=_START_TIMEOUT.get(),
        )
        try:
            await anonymous_p2p._client.connect(peer_id, [])
            return True
        except ControlFailure:
            return False
        finally:
            await anonymous_p2p.shutdown()

    patcher.replace(P2P, "create", classmethod(create_with_its_timeout_known))
    patcher.replace(P2P, "is_identity_taken", classmethod(is_identity_taken))


def servicers_collect_their_own_handlers(patcher: Patcher) -> None:
    """Each P2P servicer class collects its own ``rpc_*`` handlers and stub.

    Fixes: ``ServicerBase._collect_rpc_handlers`` caches the handlers and the stub type in class attributes and
    returns early when ``cls._rpc_handlers`` is set, which it also is when only a parent class collected them. A
    subclass created after its parent (a ``TrainingStateAverager`` or ``GradientAverager`` after a plain
    ``DecentralizedAverager`` in the same process) then registers its handlers under its own class name but calls
    its peers through the parent's stub, under the parent's name: every call fails with "protocols not supported",
    so such a process never averages or serves state. A trainer process creates its averagers in an order that
    escapes this; a test process running several tests does not. Upstream: unchanged on master. Remove when
    the cache is looked up in the class's own ``__dict__``.
    """
    from hivemind.p2p.servicer import ServicerBase

    collect = vars(ServicerBase)["_collect_rpc_handlers"].__func__

    def collect_for_this_class(cls) -> None:
        if "_rpc_handlers" not in vars(cls):
            cls._rpc_handlers = None  # shadow a parent's cache: this class's names are its own
        collect(cls)

    patcher.replace(ServicerBase, "_collect_rpc_handlers", classmethod(collect_for_this_class))


def finish_progress_tracker_tasks(patcher: Patcher) -> None:
    """End a ``ProgressTracker``'s thread with no task left pending and its event loop closed.

    Fixes: ``ProgressTracker.run`` runs its reporter and fetcher until shutdown and returns as soon as both have,
    leaving tasks they started pending (the last DHT store, which the reporter cancels only as it returns; the
    fetcher's shutdown watcher and its last DHT get) in a loop it never closes. When the garbage collector takes
    that loop, asyncio logs "Task was destroyed but it is pending!" for each, in whatever test or step is running
    then, and the loop's default executor thread is not shut down. Here the thread finishes as ``asyncio.run``
    does: it cancels what is left, waits for it, shuts the executor down and closes the loop. Every in-process
    ``hivemind.Optimizer`` has a tracker. Upstream: unchanged on master. Remove when the tracker closes its loop.
    """
    from hivemind.optim.progress_tracker import ProgressTracker

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        finally:
            try:
                left = asyncio.all_tasks(loop)
                for task in left:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                if self.shutdown_triggered.is_set():  # what the executor's threads wait for is then set
                    loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                self.shutdown_complete.set()

    patcher.replace(ProgressTracker, "run", run)


# (name, function) in the order ``install`` applies them
PROCESS_WIDE = (
    ("deliver_whole_streams", deliver_whole_streams),
    ("verify_state_downloads", verify_state_downloads),
    ("keep_inbound_stream_handlers_alive", keep_inbound_stream_handlers_alive),
    ("close_averager_p2p_on_shutdown", close_averager_p2p_on_shutdown),
    ("finish_abandoned_executor_maps", finish_abandoned_executor_maps),
    ("stream_results_to_zero_share_full_peers", stream_results_to_zero_share_full_peers),
    ("read_8bit_tensors_with_numpy_2", read_8bit_tensors_with_numpy_2),
    ("report_vanished_handle_senders", report_vanished_handle_senders),
    ("identity_check_uses_the_start_timeout", identity_check_uses_the_start_timeout),
    ("servicers_collect_their_own_handlers", servicers_collect_their_own_handlers),
    ("finish_progress_tracker_tasks", finish_progress_tracker_tasks),
)

# (name, function) of the fixes that adapt one ``hivemind.Optimizer`` (``common.optimizer``); ``install`` only puts
# them in force (:func:`put_in_force`)
PER_OPTIMIZER = (
    ("skip_nonfinite_steps", skip_nonfinite_steps),
    ("client_mode_argument", client_mode_argument),
    ("grad_buffers_for_scaler", grad_buffers_for_scaler),
)
