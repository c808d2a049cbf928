"""Volunteer networks on one machine: one Linux network namespace per emulated host.

Each host namespace gets a veth pair whose other end joins a bridge in a namespace of its own, so every
address (``10.77.0.0/24``) exists only inside namespaces this module created and traffic never touches the
machine's real interfaces. Upload/download caps are ``tc`` token-bucket filters on the two ends of the host's
veth. Latency (``delay_ms``): the kernel here has no netem, so a user-space delay line (common/tools/linkdelay.py)
holds each packet the host sends for that long before it reaches the upload cap. A host that "accepts no inbound
connections" (behind NAT or a firewall) drops new inbound connections with nftables, which is what makes a
volunteer join in client mode.

Needs root, ``ip`` and ``tc`` (iproute2), and ``nft`` (Debian package ``nftables``) for no-inbound hosts;
otherwise :class:`NetworkEmulationUnavailable` says what is missing, and launchers fall back to loopback.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

NAMESPACE_PREFIX = "dl"  # every namespace this module creates is named dl<owner pid>-<tag>-<host|br>
SUBNET_PREFIX = "10.77.0"  # /24, exists only inside our own namespaces
HOST_INTERFACE = "eth0"
BRIDGE_NAME = "br0"
_NAMESPACE_PATTERN = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)-[0-9a-f]+-")
ROLES = ("trainer", "auxiliary", "monitor")  # the role scripts of common/swarm.py


class NetworkEmulationUnavailable(UserError):
    """This machine cannot emulate hosts (no root, no namespaces, missing tool); launchers fall back to loopback."""


class NetworkEmulationError(UserError):
    """A command that builds or tears down the emulated network failed."""


@dataclass
class HostSpec:
    """One emulated host: its link caps (Mbit/s; None = uncapped) and whether it accepts inbound connections."""

    name: str = "host"
    role: str = "trainer"  # trainer | auxiliary | monitor: which role a launcher starts on this host
    upload_mbit: Optional[float] = None
    download_mbit: Optional[float] = None
    accepts_inbound: bool = True  # False = behind NAT/firewall: the peer must run in client mode
    delay_ms: float = 0.0  # one-way delay added to everything this host sends (common/tools/linkdelay.py)

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[A-Za-z0-9_-]+", self.name):
            raise ValueError(f"hosts[].name must be letters, digits, '-' or '_' (got {self.name!r})")
        if self.role not in ROLES:
            raise ValueError(f"host {self.name}: role must be one of {', '.join(ROLES)} (got {self.role!r})")
        for key in ("upload_mbit", "download_mbit"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"host {self.name}: {key} must be > 0 (got {value})")
        if not 0 <= self.delay_ms <= 5000:
            raise ValueError(f"host {self.name}: delay_ms must be within 0..5000 (got {self.delay_ms})")
        if self.role == "auxiliary" and not self.accepts_inbound:
            raise ValueError(f"host {self.name}: an auxiliary peer must accept inbound connections (it aggregates)")

    @property
    def link_mbit(self) -> Optional[float]:
        """The slower direction: what bounds this host's share of an all-reduce (it sends and receives alike)."""
        caps = [cap for cap in (self.upload_mbit, self.download_mbit) if cap is not None]
        return min(caps) if caps else None


@dataclass
class NetworkSetup:
    """A named set of emulated hosts, loaded from ``configs/network/*.yaml``."""

    name: str = "setup"
    description: str = ""
    hosts: List[HostSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("hosts must list at least one host")
        names = [host.name for host in self.hosts]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"hosts[].name must be unique (repeated: {', '.join(duplicates)})")
        if len(self.hosts) > 250:
            raise ValueError("hosts: at most 250 hosts fit the /24 subnet")
        if not any(host.accepts_inbound for host in self.hosts):
            raise ValueError(
                "hosts: at least one host must accept inbound connections (a swarm of only "
                "client-mode peers cannot connect)"
            )


def load_network_setup(path: str | Path) -> NetworkSetup:
    """Load and validate a setup YAML; problems become a one-line ConfigError naming the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"network setup file not found: {path}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(NetworkSetup), OmegaConf.load(path))
        setup = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {str(error).splitlines()[0]}") from None
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    return setup


def check_available(need_firewall: bool = False) -> None:
    """Raise NetworkEmulationUnavailable naming the missing piece (root, iproute2, nftables, namespaces)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        raise NetworkEmulationUnavailable("network emulation needs Linux network namespaces")
    if os.geteuid() != 0:
        raise NetworkEmulationUnavailable("network emulation needs root (creating network namespaces)")
    tools = ["ip", "tc"] + (["nft"] if need_firewall else [])
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        hint = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables"}
        packages = sorted({hint[tool] for tool in missing})
        raise NetworkEmulationUnavailable(
            f"network emulation needs {', '.join(missing)} (apt-get install -y {' '.join(packages)})"
        )


def _run(command: Sequence[str]) -> str:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode != 0:
        detail = " ".join((result.stderr or result.stdout).split())[:300]
        raise NetworkEmulationError(f"`{' '.join(command)}` failed: {detail}")
    return result.stdout


def list_namespaces() -> List[str]:
    if shutil.which("ip") is None:
        return []
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str, grace_seconds: float = 3.0) -> None:
    """Stop whatever still runs inside ``namespace`` (our peers and their p2pd daemons): TERM, then KILL."""

    def pids() -> List[int]:
        result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []

    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 1.0)):
        remaining = pids()
        if not remaining:
            return
        for pid in remaining:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


def delete_namespace(namespace: str) -> None:
    """Kill its processes, then delete it (its veth end and tc/nft state go with it)."""
    _kill_namespace_processes(namespace)
    result = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, text=True)
    if result.returncode != 0 and namespace in list_namespaces():
        raise NetworkEmulationError(f"could not delete network namespace {namespace}: {result.stderr.strip()}")


def cleanup_orphaned() -> List[str]:
    """Delete namespaces left by processes that died without cleaning up (their owner pid is gone)."""
    removed = []
    for name in list_namespaces():
        match = _NAMESPACE_PATTERN.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            delete_namespace(name)
            removed.append(name)
    return removed


def _tbf(rate_mbit: float, queue_ms: float) -> List[str]:
    """A token bucket for ``rate_mbit``: the bucket holds >= 64 KiB so a veth GSO packet passes whole; packets
    wait at most ``queue_ms`` in its queue before it drops them (the link's buffer)."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(96 * 1024, int(rate_bytes * 0.004))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{queue_ms:g}ms"]


class EmulatedNetwork:
    """Context manager: N host namespaces on one bridge, with rate limits and no-inbound firewalls.

    >>> with EmulatedNetwork(setup.hosts) as network:
    ...     subprocess.Popen(network.command_prefix(0) + [sys.executable, "scripts/train.py", ...,
    ...                      f"network.host_maddrs=[{network.host_maddr(0)}]"], start_new_session=True)

    Cleanup (processes inside, then namespaces) runs on ``__exit__``, on a failure while building, and at
    interpreter exit; what a SIGKILLed owner left behind is removed by the next network that starts.
    """

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        queue_ms: float = 100.0,
        congestion_control: str = "",
        notsent_lowat_bytes: int = 0,
    ):
        """``queue_ms``: the longest a packet waits in a capped link's queue (tbf ``latency``); a full upload queue
        also delays the ACKs of what the host downloads. ``congestion_control``: TCP's algorithm in every host
        namespace ("" = the kernel default, bbr on this machine). ``notsent_lowat_bytes``: the most not-yet-sent
        bytes a TCP socket in a host namespace may hold (``net.ipv4.tcp_notsent_lowat``; 0 = the kernel's default,
        unlimited): a bulk upload otherwise parks megabytes in the socket, and whatever the application writes
        after them on the same connection (libp2p multiplexes every stream and its flow-control frames over one
        connection per peer pair) waits until they have drained through the slow link."""
        if not hosts:
            raise ValueError("EmulatedNetwork needs at least one host")
        self.hosts = list(hosts)
        self.queue_ms, self.congestion_control = queue_ms, congestion_control
        self.notsent_lowat_bytes = notsent_lowat_bytes
        self.prefix = f"{NAMESPACE_PREFIX}{os.getpid()}-{secrets.token_hex(2)}-"
        self.bridge_namespace = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}{index}" for index in range(len(self.hosts))]
        self._created: List[str] = []
        self._delay_lines: List[subprocess.Popen] = []  # killed with their namespaces; reaped in close()
        self._closed = False

    # --- addresses and launching -------------------------------------------------------------
    def host_ip(self, index: int) -> str:
        return f"{SUBNET_PREFIX}.{index + 1}"

    def host_maddr(self, index: int, port: int = 0) -> str:
        """For ``network.host_maddrs``: listen on this host's own address."""
        return f"/ip4/{self.host_ip(index)}/tcp/{port}"

    def command_prefix(self, index: int) -> List[str]:
        """Prepend to a command to run it on host ``index``."""
        return ["ip", "netns", "exec", self.namespaces[index]]

    def index_of(self, name: str) -> int:
        for index, host in enumerate(self.hosts):
            if host.name == name:
                return index
        raise KeyError(f"no emulated host named {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def command_prefix_for(self, name: str) -> List[str]:
        """``command_prefix`` by host name: plugs into ``LocalSwarm(command_prefix=...)``."""
        return self.command_prefix(self.index_of(name))

    def peer_overrides(self, name: str) -> List[str]:
        """Config overrides that make a peer on host ``name`` fit it: listen on the host's address, client mode
        behind a no-inbound firewall, and declare the host's link to the load balancer. Plugs into
        ``LocalSwarm(host_overrides=...)``."""
        index = self.index_of(name)
        host = self.hosts[index]
        overrides = [f"network.host_maddrs=[{self.host_maddr(index)}]"]
        if not host.accepts_inbound:
            overrides.append("network.client_mode=true")
        if host.link_mbit is not None:
            overrides.append(f"collaboration.bandwidth={host.link_mbit:g}")
        return overrides

    def describe(self) -> Dict[str, str]:
        return {
            host.name: f"{self.host_ip(i)} up {host.upload_mbit or 'inf'} / down {host.download_mbit or 'inf'} Mbit/s"
            + ("" if host.accepts_inbound else ", no inbound")
            + (f", +{host.delay_ms:g} ms sending" if host.delay_ms else "")
            for i, host in enumerate(self.hosts)
        }

    # --- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        check_available(need_firewall=any(not host.accepts_inbound for host in self.hosts))
        cleanup_orphaned()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        logger.info(f"emulated network {self.prefix}*: " + "; ".join(f"{k} {v}" for k, v in self.describe().items()))
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors = []
        for namespace in reversed(self._created):  # hosts first: their peers die before the bridge goes
            try:
                delete_namespace(namespace)
            except NetworkEmulationError as error:
                errors.append(str(error))
        self._created.clear()
        for process in self._delay_lines:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stderr.close()
        if errors:
            raise NetworkEmulationError("; ".join(errors))

    def _add_namespace(self, namespace: str) -> None:
        try:
            _run(["ip", "netns", "add", namespace])
        except NetworkEmulationError as error:
            raise NetworkEmulationUnavailable(f"cannot create network namespaces here: {error}") from None
        self._created.append(namespace)
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _build(self) -> None:
        self._add_namespace(self.bridge_namespace)
        _run(["ip", "-n", self.bridge_namespace, "link", "add", BRIDGE_NAME, "type", "bridge"])
        _run(["ip", "-n", self.bridge_namespace, "link", "set", BRIDGE_NAME, "up"])
        for index, (host, namespace) in enumerate(zip(self.hosts, self.namespaces)):
            self._add_namespace(namespace)
            port = f"h{index}"
            # both ends are born inside our namespaces, so names never clash with the machine's interfaces
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    HOST_INTERFACE,
                    "netns",
                    namespace,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "netns",
                    self.bridge_namespace,
                ]
            )
            _run(["ip", "-n", self.bridge_namespace, "link", "set", port, "master", BRIDGE_NAME])
            _run(["ip", "-n", self.bridge_namespace, "link", "set", port, "up"])
            _run(["ip", "-n", namespace, "addr", "add", f"{self.host_ip(index)}/24", "dev", HOST_INTERFACE])
            _run(["ip", "-n", namespace, "link", "set", HOST_INTERFACE, "up"])
            if host.upload_mbit is not None:  # leaving the host = its upload
                _run(
                    ["tc", "-n", namespace, "qdisc", "replace", "dev", HOST_INTERFACE, "root"]
                    + _tbf(host.upload_mbit, self.queue_ms)
                )
            if host.download_mbit is not None:  # leaving the bridge port towards the host = its download
                _run(
                    ["tc", "-n", self.bridge_namespace, "qdisc", "replace", "dev", port, "root"]
                    + _tbf(host.download_mbit, self.queue_ms)
                )
            if not host.accepts_inbound:
                self._block_inbound(namespace)
            if self.congestion_control:
                _run(
                    ["ip", "netns", "exec", namespace, "sysctl", "-qw"]
                    + [f"net.ipv4.tcp_congestion_control={self.congestion_control}"]
                )
            if self.notsent_lowat_bytes:
                _run(
                    ["ip", "netns", "exec", namespace, "sysctl", "-qw"]
                    + [f"net.ipv4.tcp_notsent_lowat={self.notsent_lowat_bytes}"]
                )
            if host.delay_ms > 0:
                self._add_delay_line(index, port)

    def _add_delay_line(self, index: int, port: str) -> None:
        """Route this host's traffic to the subnet through a TUN device served by a delay-line process, whose
        marked output policy routing sends out through the real interface (common/tools/linkdelay.py)."""
        from common.tools import linkdelay

        namespace, ip, subnet = self.namespaces[index], self.host_ip(index), f"{SUBNET_PREFIX}.0/24"
        host_ns = ["ip", "-n", namespace]
        for command in (
            host_ns + ["link", "set", HOST_INTERFACE, "mtu", str(linkdelay.LINK_MTU)],
            ["ip", "-n", self.bridge_namespace, "link", "set", port, "mtu", str(linkdelay.LINK_MTU)],
            host_ns + ["tuntap", "add", "dev", linkdelay.TUN_NAME, "mode", "tun"],
            host_ns + ["link", "set", linkdelay.TUN_NAME, "mtu", str(linkdelay.TUN_MTU), "up"],
            host_ns
            + ["route", "add", subnet, "dev", HOST_INTERFACE, "src", ip, "table", str(linkdelay.FORWARD_TABLE)],
            host_ns + ["rule", "add", "fwmark", str(linkdelay.FORWARD_MARK), "lookup", str(linkdelay.FORWARD_TABLE)],
            host_ns + ["route", "replace", subnet, "dev", linkdelay.TUN_NAME, "src", ip],
            # replies arrive on eth0 while the route back points at the TUN device: no reverse-path filtering
            ["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"],
            ["ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.conf.{HOST_INTERFACE}.rp_filter=0"],
        ):
            _run(command)
        delay_ms = self.hosts[index].delay_ms
        process = subprocess.Popen(
            self.command_prefix(index)
            + [sys.executable, "-m", "common.tools.linkdelay", "--delay-ms", f"{delay_ms:g}"],
            cwd=Path(__file__).resolve().parents[2],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._delay_lines.append(process)
        # a persistent TUN device reports NO-CARRIER until a process attaches to it
        deadline = time.monotonic() + 30
        while "NO-CARRIER" in _run(host_ns + ["link", "show", linkdelay.TUN_NAME]):
            if process.poll() is not None or time.monotonic() > deadline:
                detail = process.stderr.read().decode()[-300:] if process.poll() is not None else "timed out"
                raise NetworkEmulationError(f"the delay line of host {self.hosts[index].name} did not start: {detail}")
            time.sleep(0.05)

    def _block_inbound(self, namespace: str) -> None:
        """Like a home router's NAT: replies to our own connections pass, new inbound connections are dropped."""
        ruleset = (
            "table inet dedloc_no_inbound {\n"
            "  chain input {\n"
            "    type filter hook input priority 0; policy accept;\n"
            f'    iifname "{HOST_INTERFACE}" ct state new drop\n'
            "  }\n"
            "}\n"
        )
        result = subprocess.run(
            ["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=ruleset, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise NetworkEmulationError(f"nft in {namespace} failed: {' '.join(result.stderr.split())[:300]}")


# --- traffic counters ------------------------------------------------------------------------------------------
# Read from outside the namespaces, by a process that did not create them (e.g. a driver polling a launcher's
# network): the namespace names carry their owner's pid, so the owner's hosts are found without asking it.


def host_namespaces(owner_pid: int) -> Dict[int, str]:
    """The host namespaces (by host index) of the EmulatedNetwork that process ``owner_pid`` runs now."""
    found = {}
    for name in list_namespaces():
        match = re.fullmatch(rf"{NAMESPACE_PREFIX}{owner_pid}-[0-9a-f]+-(\d+)", name)
        if match:
            found[int(match.group(1))] = name
    return found


def parse_interface_bytes_sent(link_json: str, interface: str = HOST_INTERFACE) -> Optional[int]:
    """Bytes ``interface`` transmitted, from ``ip -s -j link`` (headers and retransmissions included: what the host
    put on its link); None if the interface is not listed."""
    for entry in json.loads(link_json or "[]"):
        if entry.get("ifname") == interface:
            return int(entry["stats64"]["tx"]["bytes"])
    return None


def ss_connections(listing: str) -> List[Tuple[List[str], int]]:
    """Each connection's fields (state, queues, local and peer address, then ``-p``'s users if asked) and the bytes
    it sent, from ``ss -tinH``: a connection's line is followed by an indented line of its counters."""
    connections = []
    fields = None
    for line in listing.splitlines():
        if not line.startswith((" ", "\t")):
            fields = line.split()
            continue
        sent = re.search(r"bytes_sent:(\d+)", line)
        if fields is not None and len(fields) >= 5 and sent is not None:
            connections.append((fields, int(sent.group(1))))
        fields = None
    return connections


def parse_tcp_bytes_sent(listing: str) -> Dict[Tuple[str, str], int]:
    """TCP payload bytes sent per connection, keyed by (local, peer) address, from ``ss -tinH`` (no ``-p``)."""
    return {(fields[3], fields[4]): sent for fields, sent in ss_connections(listing)}


def address_host(address: str) -> Optional[int]:
    """The host index an ``ip:port`` of the emulated subnet belongs to (None outside it)."""
    match = re.fullmatch(rf"{re.escape(SUBNET_PREFIX)}\.(\d+):\d+", address)
    return int(match.group(1)) - 1 if match else None


class HostTraffic:
    """What each emulated host of a running network sent: its link's transmitted bytes, and its TCP bytes per
    destination host, sampled from outside (``sample()``, e.g. every 2 s) while the owner's network exists.

    The link counter is cumulative and complete up to the last sample (the last one lands at most one poll
    before the owner tears the network down, after its peers stopped). The TCP counters split that traffic by
    destination (e.g. to leave out what a host sent to the monitor): each connection's count is the largest seen,
    so a connection that opens and closes between two samples, or what one sends in its last poll interval, is
    missed, and the split is a lower bound. Loopback connections inside a host are not counted.
    """

    def __init__(self, owner_pid: int, host_names: Sequence[str]):
        self.owner_pid, self.host_names = owner_pid, list(host_names)
        self.link_sent: Dict[str, int] = {}
        self.connections: Dict[Tuple[str, str, str], int] = {}  # (host, local, peer) -> bytes sent

    def sample(self) -> None:
        for index, namespace in host_namespaces(self.owner_pid).items():
            if index >= len(self.host_names):
                continue
            host = self.host_names[index]
            links = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link"], capture_output=True, text=True)
            sockets = subprocess.run(["ss", "-N", namespace, "-tinH"], capture_output=True, text=True)
            if links.returncode == 0:
                sent = parse_interface_bytes_sent(links.stdout)
                if sent is not None:
                    self.link_sent[host] = max(self.link_sent.get(host, 0), sent)
            if sockets.returncode == 0:
                for (local, peer), sent in parse_tcp_bytes_sent(sockets.stdout).items():
                    if address_host(peer) is None:
                        continue  # a loopback connection inside the host
                    key = (host, local, peer)
                    self.connections[key] = max(self.connections.get(key, 0), sent)

    def tcp_sent_to(self) -> Dict[str, Dict[str, int]]:
        """TCP bytes each host sent, per destination host."""
        totals: Dict[str, Dict[str, int]] = {}
        for (host, _, peer), sent in self.connections.items():
            index = address_host(peer)
            destination = self.host_names[index] if index is not None and index < len(self.host_names) else peer
            totals.setdefault(host, {})
            totals[host][destination] = totals[host].get(destination, 0) + sent
        return totals
