"""An averager that shuts down leaves no Unix socket file of its p2p client behind (the fix
``close_averager_p2p_on_shutdown``; ``pytest --without-patch close_averager_p2p_on_shutdown`` fails it)."""

from pathlib import Path

import hivemind
import psutil
import torch


def p2p_client_sockets(pid: int) -> list:
    """The hivemind p2p client sockets a process listens on."""
    return [
        connection.laddr
        for connection in psutil.Process(pid).net_connections(kind="unix")
        if "hivemind-p2pclient" in (connection.laddr or "")
    ]


def test_averager_shutdown_removes_its_p2p_client_socket():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        averager = hivemind.DecentralizedAverager(
            averaged_tensors=[torch.zeros(4)], dht=dht, prefix="socket_test", target_group_size=2, start=True
        )
        sockets = p2p_client_sockets(averager.pid)
        assert sockets and all(Path(path).exists() for path in sockets)
        averager.shutdown()
        assert not averager.is_alive()
        assert [path for path in sockets if Path(path).exists()] == []
    finally:
        dht.shutdown()
