"""Counts every RPC a hivemind process sends, by handler name (a measurement aid, never part of a peer).

Put this folder first on PYTHONPATH: Python imports ``sitecustomize`` at start-up, before any peer code. Each
process (and each child it forks: hivemind's DHT and averager processes) then writes, every 3 s, the protobuf bytes
of the requests it made and of the responses it gave, per handler name, to ``$RPC_BYTES_DIR/<pid>.json``.
DHT lookups are also split by key: the bytes of the FIND responses this process gave, per key it was asked for
(``find:<key>``; a response for several keys is shared out evenly). Protobuf bytes leave out libp2p's and TCP's
framing; ``summarise.py`` adds them up per peer.
"""

import collections
import functools
import json
import os
import sys
import threading
import time

OUTPUT = os.environ.get("RPC_BYTES_DIR")


def _install() -> None:
    from hivemind.p2p import p2p_daemon

    sent = collections.defaultdict(lambda: [0, 0])  # "req:<name>" / "resp:<name>" -> [bytes, messages]

    def count(name, message) -> None:
        entry = sent[name]
        entry[0] += message.ByteSize()
        entry[1] += 1

    async def counted(name, messages):
        async for message in messages:
            count(name, message)
            yield message

    add_handler = p2p_daemon.P2P.add_protobuf_handler

    async def add_protobuf_handler(self, name, handler, input_type, *, stream_input=False, stream_output=False, **kw):
        if stream_output:

            async def wrapped(request, context):
                async for message in handler(request, context):
                    count(f"resp:{name}", message)
                    yield message
        else:

            async def wrapped(request, context):
                message = await handler(request, context)
                count(f"resp:{name}", message)
                return message

        return await add_handler(
            self, name, wrapped, input_type, stream_input=stream_input, stream_output=stream_output, **kw
        )

    def counted_input(name, request):
        if hasattr(request, "ByteSize"):
            count(f"req:{name}", request)
            return request
        return counted(f"req:{name}", request)

    call, iterate = p2p_daemon.P2P.call_protobuf_handler, p2p_daemon.P2P.iterate_protobuf_handler

    async def call_protobuf_handler(self, peer_id, name, request, output_type):
        return await call(self, peer_id, name, counted_input(name, request), output_type)

    def iterate_protobuf_handler(self, peer_id, name, request, output_type, **kw):
        return iterate(self, peer_id, name, counted_input(name, request), output_type, **kw)

    from hivemind.dht import node, protocol
    from hivemind.dht.routing import DHTID

    key_names = {}  # DHTID hex -> the key as the code named it

    def name_keys(method):
        @functools.wraps(method)
        async def named(self, keys, *args, **kwargs):
            for key in keys:
                key_names[DHTID.generate(source=key).to_bytes().hex()] = str(key)
            return await method(self, keys, *args, **kwargs)

        return named

    node.DHTNode.store_many = name_keys(node.DHTNode.store_many)
    node.DHTNode.get_many = name_keys(node.DHTNode.get_many)
    rpc_find = protocol.DHTProtocol.rpc_find

    @functools.wraps(rpc_find)  # hivemind reads the handler's type annotations
    async def counted_rpc_find(self, request, context):
        response = await rpc_find(self, request, context)
        for key in request.keys:
            entry = sent[f"find:{key_names.get(key.hex(), key.hex()[:12])}"]
            entry[0] += response.ByteSize() // max(len(request.keys), 1)
            entry[1] += 1
        return response

    protocol.DHTProtocol.rpc_find = counted_rpc_find
    p2p_daemon.P2P.add_protobuf_handler = add_protobuf_handler
    p2p_daemon.P2P.call_protobuf_handler = call_protobuf_handler
    p2p_daemon.P2P.iterate_protobuf_handler = iterate_protobuf_handler

    def write() -> None:
        path = os.path.join(OUTPUT, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as handle:
            json.dump({"argv": sys.argv, "sent": dict(sent)}, handle)
        os.replace(path + ".tmp", path)

    def keep_writing() -> None:
        while True:
            time.sleep(3)
            if sent:
                write()

    def start_writer() -> None:
        threading.Thread(target=keep_writing, daemon=True).start()

    start_writer()
    os.register_at_fork(after_in_child=start_writer)  # a forked child has no threads: start its own writer


if OUTPUT and "hivemind" not in sys.modules:
    try:
        _install()
    except ImportError:  # an interpreter without hivemind (a tool, not a peer)
        pass
