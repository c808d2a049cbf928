"""Measured bandwidth: a short timed transfer to a peer already in the swarm, through hivemind's own p2p.

hivemind's load balancer splits each all-reduce by the *declared* ``bandwidth`` of every peer. A volunteer
rarely knows its real figure, so a peer can measure it at start-up: it streams payload to a peer it already
knows (upload), then asks that peer to stream payload back (download), both through the same libp2p daemon
and transport the averager uses. Every peer serves the probe (:func:`serve_bandwidth_probe`), so the
measuring peer can pick any of its initial peers.

The handler and the measurement run inside the DHT process (``DHT.run_coroutine``), next to the p2p
daemon connection the DHT already holds: nothing else is started.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

logger = logging.getLogger(__name__)

PROBE_HANDLER = "dedloc_bandwidth_probe"
CHUNK_BYTES = 256 * 1024
MAX_PROBE_SECONDS = 30.0  # a served download never runs longer, whatever the request says


@dataclass(frozen=True)
class LinkMeasurement:
    upload_mbit: float
    download_mbit: float
    seconds_each_way: float
    peer: str

    @property
    def link_mbit(self) -> float:
        """What bounds this peer in an all-reduce: it must send and receive the same amount."""
        return min(self.upload_mbit, self.download_mbit)


async def _probe_handler(
    requests: AsyncIterator[runtime_pb2.ExpertRequest], _context: P2PContext
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """First message says what to do: ``{"direction": "upload"}`` (count what follows) or
    ``{"direction": "download", "seconds": s}`` (send payload for ``s`` seconds)."""
    first = None
    received_bytes, first_chunk_time, last_chunk_time = 0, None, None
    async for request in requests:
        if first is None:
            first = json.loads(request.metadata.decode())
            if first.get("direction") == "download":
                break
            continue
        received_bytes += len(request.metadata)
        last_chunk_time = time.perf_counter()
        if first_chunk_time is None:
            first_chunk_time = last_chunk_time
    if first is not None and first.get("direction") == "download":
        seconds = min(float(first.get("seconds", 1.0)), MAX_PROBE_SECONDS)
        payload = bytes(CHUNK_BYTES)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            yield runtime_pb2.ExpertResponse(metadata=payload)
        return
    elapsed = (last_chunk_time - first_chunk_time) if first_chunk_time is not None else 0.0
    yield runtime_pb2.ExpertResponse(metadata=json.dumps({"bytes": received_bytes, "seconds": elapsed}).encode())


async def _register_probe(_dht: hivemind.DHT, node) -> None:
    await node.p2p.add_protobuf_handler(
        PROBE_HANDLER, _probe_handler, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
    )


def serve_bandwidth_probe(dht: hivemind.DHT) -> None:
    """Let other peers measure their link to this one (call once after the DHT starts)."""
    dht.run_coroutine(_register_probe)


async def _upload_stream(seconds: float) -> AsyncIterator[runtime_pb2.ExpertRequest]:
    yield runtime_pb2.ExpertRequest(metadata=json.dumps({"direction": "upload"}).encode())
    payload = bytes(CHUNK_BYTES)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        yield runtime_pb2.ExpertRequest(metadata=payload)


async def _measure(peer_id_bytes: bytes, seconds: float, _dht: hivemind.DHT, node) -> tuple:
    peer_id = PeerID(peer_id_bytes)
    # upload: the server counts bytes between its first and last received chunk, so our send buffers don't count
    upload_rate = 0.0
    async for response in await node.p2p.iterate_protobuf_handler(
        peer_id, PROBE_HANDLER, _upload_stream(seconds), runtime_pb2.ExpertResponse
    ):
        report = json.loads(response.metadata.decode())
        upload_rate = report["bytes"] / report["seconds"] if report["seconds"] > 0 else 0.0
    request = runtime_pb2.ExpertRequest(metadata=json.dumps({"direction": "download", "seconds": seconds}).encode())
    received_bytes, first_chunk_time, last_chunk_time = 0, None, None
    async for response in await node.p2p.iterate_protobuf_handler(
        peer_id, PROBE_HANDLER, request, runtime_pb2.ExpertResponse
    ):
        last_chunk_time = time.perf_counter()
        if first_chunk_time is None:
            first_chunk_time = last_chunk_time  # the first chunk's bytes arrived before the clock started
        else:
            received_bytes += len(response.metadata)
    download_rate = received_bytes / (last_chunk_time - first_chunk_time) if received_bytes else 0.0
    return upload_rate * 8 / 1e6, download_rate * 8 / 1e6


def measure_link(dht: hivemind.DHT, peer_id: PeerID, seconds: float = 2.0) -> LinkMeasurement:
    """Time ``seconds`` of upload to and download from ``peer_id`` (which runs ``serve_bandwidth_probe``)."""
    if not seconds > 0:
        raise ValueError("seconds must be > 0")
    upload, download = dht.run_coroutine(functools.partial(_measure, peer_id.to_bytes(), seconds))
    return LinkMeasurement(
        upload_mbit=upload, download_mbit=download, seconds_each_way=seconds, peer=peer_id.to_base58()
    )


def measure_link_to_initial_peer(dht: hivemind.DHT, initial_peer: str, seconds: float = 2.0) -> LinkMeasurement:
    """Measure against a multiaddr from ``network.initial_peers`` (it names the peer: ``.../p2p/<id>``)."""
    if "/p2p/" not in initial_peer:
        raise ValueError(f"initial peer address {initial_peer!r} lacks the /p2p/<peer id> part")
    return measure_link(dht, PeerID.from_base58(initial_peer.rsplit("/p2p/", 1)[1]), seconds)


def bandwidth_for_averager(declared_mbit: Optional[float], measurement: Optional[LinkMeasurement]) -> Optional[float]:
    """The ``bandwidth`` to give hivemind's averager: the measured link if there is one, else the declared
    figure; logs both so a wrong declaration shows up."""
    if measurement is None:
        logger.info(
            f"bandwidth: declared {declared_mbit if declared_mbit is not None else 'none (swarm default)'} "
            f"Mbit/s, not measured"
        )
        return declared_mbit
    logger.info(
        f"bandwidth: declared {declared_mbit if declared_mbit is not None else 'none'} Mbit/s, measured "
        f"upload {measurement.upload_mbit:.1f} / download {measurement.download_mbit:.1f} Mbit/s "
        f"against {measurement.peer[:12]}; using {measurement.link_mbit:.1f}"
    )
    return measurement.link_mbit
