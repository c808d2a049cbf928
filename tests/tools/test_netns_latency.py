"""Added latency on emulated hosts: the user-space delay line (common/tools/linkdelay.py) behind ``delay_ms``."""

import subprocess
import time

import pytest

from common.tools.netns import EmulatedNetwork, HostSpec, list_namespaces
from tests.helpers import leftover_namespaces, needs_network_namespaces, own_processes, python_on_host, running

# the server answers one byte per connection; the client times TCP handshakes (1 round trip each) and a
# request-response (1 more), then streams 3 MB to check the delayed link still carries its rate
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 7100))
while True:
    connection, _ = server.accept()
    if connection.recv(1) == b"r":
        connection.sendall(b"a")
    else:
        while connection.recv(1 << 20):
            pass
        connection.sendall(b"d")
    connection.close()
"""
CLIENT = """
import socket, sys, time
address = (sys.argv[1], 7100)
handshakes, exchanges = [], []
for _ in range(3):
    started = time.monotonic()
    connection = socket.create_connection(address, timeout=10)
    handshakes.append(time.monotonic() - started)
    started = time.monotonic()
    connection.sendall(b"r")
    connection.recv(1)
    exchanges.append(time.monotonic() - started)
    connection.close()
connection = socket.create_connection(address, timeout=30)
started = time.monotonic()
connection.sendall(b"x" * 3_000_000)
connection.shutdown(socket.SHUT_WR)
connection.recv(1)
print(min(handshakes), min(exchanges), 24e6 / (time.monotonic() - started) / 1e6)
"""


def measure(delays_ms, upload_mbit=40.0):
    hosts = [
        HostSpec(f"h{i}", upload_mbit=upload_mbit, download_mbit=upload_mbit, delay_ms=d)
        for i, d in enumerate(delays_ms)
    ]
    with EmulatedNetwork(hosts) as network, running(python_on_host(network, 1, SERVER, network.host_ip(1))):
        time.sleep(0.5)
        client = python_on_host(network, 0, CLIENT, network.host_ip(1))
        result = subprocess.run(client, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return [float(value) for value in result.stdout.split()]


@needs_network_namespaces
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_delay_line_adds_the_round_trip_and_keeps_the_rate():
    before = set(list_namespaces())
    handshake_s, exchange_s, mbit = measure([30.0, 50.0])  # a round trip crosses both hosts' delay lines
    assert 0.075 <= handshake_s <= 0.130, handshake_s
    assert 0.075 <= exchange_s <= 0.130, exchange_s
    assert mbit >= 0.5 * 40, mbit  # slow start over 80 ms costs some, but the link still carries its rate
    baseline_handshake_s, _, _ = measure([0.0, 0.0])
    assert baseline_handshake_s < 0.02, baseline_handshake_s  # no delay line: namespaces add ~nothing
    assert not leftover_namespaces(before), "namespaces left behind"
    assert not own_processes("common.tools.linkdelay"), "a delay line outlived its network"


def test_delay_must_be_in_range():
    with pytest.raises(ValueError, match="delay_ms"):
        HostSpec("h", delay_ms=-1)
