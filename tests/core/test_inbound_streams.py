"""An inbound p2p stream whose handler waits with the socket's reading paused survives a garbage collection (the fix
``keep_inbound_stream_handlers_alive``; ``pytest --without-patch keep_inbound_stream_handlers_alive`` fails it)."""

import asyncio
import gc
import weakref

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID, StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import write_pbmsg
from hivemind.utils.multiaddr import Multiaddr

PROTOCOL = "/dedloc/test/1"


async def handler_alive_after_collection(socket_path: str) -> bool:
    """Open a stream to a ControlClient as the p2p daemon does, send more than the reader buffers (so the server
    side stops reading) while the handler waits on something else, collect garbage; is the handler still there?"""
    client = ControlClient(None, Multiaddr(f"/unix{socket_path}"), _initialized_with_create=True)
    handler_tasks, handler_started = [], asyncio.Event()

    async def wait_for_a_signal_that_never_comes(stream_info, reader, writer):
        handler_tasks.append(weakref.ref(asyncio.current_task()))
        handler_started.set()
        await asyncio.get_running_loop().create_future()

    client.handlers[PROTOCOL] = wait_for_a_signal_that_never_comes
    async with client.listen():
        _reader, writer = await asyncio.open_unix_connection(socket_path)
        info = StreamInfo(PeerID(b"\x00\x01peer"), Multiaddr("/ip4/127.0.0.1/tcp/1"), PROTOCOL)
        await write_pbmsg(writer, info.to_protobuf())
        writer.write(b"x" * (1 << 20))  # far more than the 2 x 64 KiB a StreamReader buffers before pausing
        await asyncio.wait_for(handler_started.wait(), timeout=10)
        await asyncio.sleep(0.5)  # the server side fills its buffer and pauses reading
        gc.collect()
        alive = handler_tasks[0]() is not None
        writer.close()
        for task in [ref() for ref in handler_tasks if ref() is not None]:
            task.cancel()
        return alive


def test_paused_inbound_stream_handler_survives_garbage_collection(tmp_path):
    assert asyncio.run(handler_alive_after_collection(str(tmp_path / "control.sock")))
