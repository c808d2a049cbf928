"""Added latency for an emulated host, in user space: a delay line between a TUN device and the host's link.

The kernel here has no ``netem`` (nor ``fq``, which could delay packets stamped by BPF), so latency is added by
a small process inside the host's namespace (:class:`common.tools.netns.EmulatedNetwork` starts it):

* traffic to the other hosts is routed into a TUN device (``lat0``); this process reads each IP packet, holds it
  for ``delay_ms`` and then sends it out through a raw socket whose packets carry a firewall mark that policy
  routing sends through the real interface (``eth0``, where the upload cap applies);
* what arrives on ``eth0`` is delivered directly, so a host delays only what it *sends*: the round trip between
  hosts A and B gains ``delay_A + delay_B``.

Why user space and not an in-kernel queue (nftables ``queue``, a BPF program): a packet held inside the kernel
stays charged to its TCP socket, and TCP's small-queue limit (about a millisecond of data per socket) would then
throttle every flow to that amount per delay -- netem avoids this by orphaning packets, which nothing else here
does. A packet read from a TUN device is released by the socket at once, as on a real wire.

The TUN device's MTU is large (64000) so that a TCP flow at hundreds of Mb/s is a few thousand packets per
second, which a Python loop keeps up with; the host's veth MTU is raised to match.

    ip netns exec <host namespace> python -m common.tools.linkdelay --delay-ms 50
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import logging
import os
import select
import signal
import socket
import struct
import sys
import time

logger = logging.getLogger(__name__)

TUN_NAME = "lat0"
TUN_MTU = 64000
LINK_MTU = 65535  # veth maximum: a delayed TUN packet (64000 bytes) must fit the real link unfragmented
FORWARD_MARK = 0x77  # packets the delay line sends carry this mark ...
FORWARD_TABLE = 77  # ... and this routing table sends them through the real interface
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65536


def open_tun(name: str = TUN_NAME) -> int:
    """Attach to the (persistent) TUN device ``name``; returns a non-blocking file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def raw_sender() -> socket.socket:
    """A raw IP socket: it sends packets exactly as read (header included), marked for the real interface."""
    sender = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, FORWARD_MARK)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * 2**20)
    return sender


def run_delay_line(delay_s: float, tun_fd: int, sender: socket.socket, should_stop) -> None:
    """Forward every packet from the TUN device ``delay_s`` seconds after it arrived, in arrival order."""
    pending: collections.deque = collections.deque()
    while not should_stop():
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else 0.2
        readable, _, _ = select.select([tun_fd], [], [], timeout)
        if readable:
            arrived = time.monotonic()
            while True:
                try:
                    packet = os.read(tun_fd, MAX_PACKET)
                except BlockingIOError:
                    break
                if len(packet) >= 20 and packet[0] >> 4 == 4:  # IPv4 only: the emulated subnet
                    pending.append((arrived + delay_s, packet))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, packet = pending.popleft()
            try:
                sender.sendto(packet, (socket.inet_ntoa(packet[16:20]), 0))
            except OSError:  # a full upload queue drops the packet, as a router would; TCP resends it
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to each sent packet")
    parser.add_argument("--tun", default=TUN_NAME)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [linkdelay] %(levelname)s %(message)s")
    stopping = []
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: stopping.append(True))
    try:
        tun_fd = open_tun(args.tun)
        sender = raw_sender()
    except OSError as error:
        logger.error(f"cannot open the delay line ({args.tun}): {error}")
        sys.exit(2)
    try:
        run_delay_line(args.delay_ms / 1000, tun_fd, sender, lambda: bool(stopping))
    finally:
        os.close(tun_fd)
        sender.close()


if __name__ == "__main__":
    main()
