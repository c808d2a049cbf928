"""Starting a hivemind DHT node from config, with clear errors and the join command for the next volunteer."""

from __future__ import annotations

import ipaddress
import itertools
import logging
import shlex
import socket
import time
from typing import List, Optional, Sequence, Union

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.multiaddr import Multiaddr

from common import hivemind_patches
from common.config import NetworkConfig
from common.errors import PeerError

logger = logging.getLogger(__name__)


def validate_multiaddrs(addresses: Sequence[str], what: str) -> List[str]:
    """Parse each address as a multiaddr; initial peers must also name the peer (``/p2p/<id>``)."""
    for address in addresses:
        try:
            parsed = Multiaddr(address)
        except Exception as error:  # multiaddr raises several exception types
            raise PeerError(f"malformed {what} address {address!r}: {error}") from None
        if what == "initial peer" and "p2p" not in [protocol.name for protocol in parsed.protocols()]:
            raise PeerError(f"initial peer address {address!r} lacks the /p2p/<peer id> part")
    return list(addresses)


STARTUP_RETRY_MAX_SECONDS = 30.0  # the longest pause between two attempts to start and join


def start_dht(
    network: NetworkConfig,
    record_validators: Sequence = (),
    authorizer: Optional[AuthorizerBase] = None,
    kept_port: Optional[int] = None,
    stop=None,
) -> hivemind.DHT:
    """Start this process's DHT node (must run in the main thread: hivemind requires it). With an ``authorizer``
    (``common.auth``), DHT requests and responses carry access tokens and unauthorized peers are refused.
    ``kept_port``: listen there instead of on a port chosen by the system (``tcp/0``), unless it is taken. ``stop``
    (a ``common.lifecycle.StopFlag``): a SIGINT/SIGTERM between two attempts ends the process with exit code 0.

    A busy machine may start the p2p daemon slowly and initial peers may be gone (a peer that restarted on another
    port leaves a dead address behind): the start and the bootstrap are retried with backoff (one WARNING line per
    failed attempt) until ``network.startup_deadline``; joining through any one live initial peer is enough."""
    initial_peers = validate_multiaddrs(network.initial_peers, "initial peer")
    validate_multiaddrs(network.host_maddrs, "host")
    validate_multiaddrs(network.announce_maddrs, "announce")
    if network.client_mode and not initial_peers:
        raise PeerError(
            "a client-mode peer accepts no inbound connections, so it cannot start a swarm: "
            "give network.initial_peers of a peer that is not in client mode"
        )
    # every peer role starts here, before any hivemind process (the DHT's, later the averagers') is forked
    hivemind_patches.install()
    deadline = time.monotonic() + network.startup_deadline
    host_maddrs = list(network.host_maddrs)
    if kept_port is not None:
        if port_is_free(kept_port):
            host_maddrs = [address.replace("/tcp/0", f"/tcp/{kept_port}") for address in host_maddrs]
        else:
            logger.warning(f"port {kept_port}, where this peer listened before, is taken: listening on a new port")
    for attempt in itertools.count(1):
        failure = None
        try:
            dht = _start_dht_once(network, host_maddrs, initial_peers, record_validators, authorizer)
        except (P2PDaemonError, RuntimeError, TimeoutError, OSError, ValueError) as error:
            failure = " ".join(str(error).split())[:300]
        else:
            try:
                connected = not initial_peers or dht.run_coroutine(_count_neighbours) > 0
            except BaseException:
                dht.shutdown()
                raise
            if connected:
                break
            dht.shutdown()
            failure = (
                f"no initial peer answered as a DHT server within {network.bootstrap_timeout:.0f} s "
                f"(unreachable, or every peer is in client mode)"
            )
        delay = min(STARTUP_RETRY_MAX_SECONDS, 2.0 ** (attempt - 1))
        if time.monotonic() + delay > deadline:
            raise PeerError(
                f"could not start the DHT node or join through any initial peer ({attempt} attempt(s) in "
                f"{network.startup_deadline:.0f} s; network.startup_deadline): tried {initial_peers or 'none'}; "
                f"last failure: {failure}"
            )
        logger.warning(f"start-up attempt {attempt} failed ({failure}); retrying in {delay:.0f} s")
        if stop is not None and (stop.is_set() or stop.wait(delay)):
            logger.info("stopped before joining the swarm")
            raise SystemExit(0)
        if stop is None:
            time.sleep(delay)
    problem = unrouted_addresses_problem(initial_peers if initial_peers else visible_multiaddrs(dht))
    if problem is not None:
        logger.warning(problem)
    return dht


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every interface (as p2pd does, reusing the address)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def listening_port(dht: hivemind.DHT) -> Optional[int]:
    """The TCP port this peer listens on, from its visible addresses (None if it has none)."""
    for address in dht.get_visible_maddrs():
        if "tcp" in [protocol.name for protocol in address.protocols()]:
            return int(address.value_for_protocol("tcp"))
    return None


def _start_dht_once(network, host_maddrs, initial_peers, record_validators, authorizer) -> hivemind.DHT:
    return hivemind.DHT(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=list(network.announce_maddrs) or None,
        client_mode=network.client_mode,
        identity_path=network.identity_path,
        use_relay=network.use_relay,
        use_auto_relay=network.use_auto_relay,
        record_validators=list(record_validators),
        bootstrap_timeout=network.bootstrap_timeout,
        authorizer=authorizer,
        startup_timeout=network.daemon_start_timeout,
        start=True,
    )


# Address ranges reserved for documentation and benchmarks (RFC 5737, RFC 2544). The peer routing of p2pd (libp2p's
# Kademlia DHT) never adds a peer connected through such an address to its routing table, so no peer can find
# another by peer id: a p2p stream to a peer this one is not already connected to fails with "routing: not found".
# Peers with a direct connection (one dialled the other: it was among its initial peers) still reach each other, in
# both directions. Checked with p2pd daemons in a network namespace per range (tests/core/test_reserved_ranges.py):
# these four ranges fail by id and work when dialled directly; 10/8, 172.16/12, 192.168/16, 100.64/10, loopback and
# a public address work either way. So a swarm joined through one such address averages only between peers that
# listed each other as initial peers, and a volunteer pasting one entry address averages with nobody.
UNROUTED_BY_LIBP2P = tuple(
    ipaddress.ip_network(block) for block in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15")
)


def in_unrouted_range(address: str) -> bool:
    """Whether ``address`` names an IP in one of the ranges libp2p's peer routing ignores."""
    ip = _ip_of(address)
    return ip is not None and any(ip in block for block in UNROUTED_BY_LIBP2P)


def unrouted_addresses_problem(addresses: Sequence[str]) -> Optional[str]:
    """A warning when the swarm would be joined through ``addresses`` (the initial peers, or this peer's own for the
    first peer) and every IP address among them is one libp2p's peer routing ignores; None otherwise."""
    ips = [_ip_of(address) for address in addresses]
    ips = [ip for ip in ips if ip is not None]
    if not ips or not all(any(ip in block for block in UNROUTED_BY_LIBP2P) for ip in ips):
        return None
    return (
        f"the swarm is joined through {', '.join(sorted({str(ip) for ip in ips}))}, in a range reserved for "
        f"documentation or benchmarks that libp2p's peer routing ignores: this peer reaches only the peers it is "
        f"directly connected to (its initial peers, and those that list it among theirs), so it averages only with "
        f'those; streams to any other fail with "routing: not found". On one machine listen on loopback '
        f"(network.host_maddrs=[/ip4/127.0.0.1/tcp/0]) and join through "
        f"the loopback address; across machines use private or public addresses (network.announce_maddrs)"
    )


def _ip_of(address: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    parsed = Multiaddr(address)
    for family in ("ip4", "ip6"):
        if family in [protocol.name for protocol in parsed.protocols()]:
            return ipaddress.ip_address(parsed.value_for_protocol(family))
    return None


async def _count_neighbours(_dht, node) -> int:
    return sum(len(bucket.nodes_to_peer_id) for bucket in node.protocol.routing_table.buckets)


def visible_multiaddrs(dht: hivemind.DHT) -> List[str]:
    """This peer's addresses that another machine can dial (see :func:`dialable`)."""
    return dialable([str(address) for address in dht.get_visible_maddrs()])


def dialable(addresses: Sequence[str]) -> List[str]:
    """Drop the addresses only this machine can use: loopback and link-local ones go whenever any other address
    exists (a peer listening on every interface reports all of them); with nothing else, loopback is kept (a
    machine without a network can still host a local swarm). Relay (``/p2p-circuit``) addresses are kept."""
    kinds = {address: _address_kind(address) for address in addresses}
    for wanted in (("routable", "relay"), ("link-local",)):
        chosen = [address for address in addresses if kinds[address] in wanted]
        if chosen:
            return chosen
    return list(addresses)


def _address_kind(address: str) -> str:
    parsed = Multiaddr(address)
    names = [protocol.name for protocol in parsed.protocols()]
    if "p2p-circuit" in names:
        return "relay"
    for family in ("ip4", "ip6"):
        if family in names:
            ip = ipaddress.ip_address(parsed.value_for_protocol(family))
            if ip.is_loopback:
                return "loopback"
            return "link-local" if ip.is_link_local else "routable"
    return "routable"  # a DNS name: the announcer chose it for others to use


VOLUNTEER_PYTHON = ".venv/bin/python"  # what scripts/setup_env.sh creates in every clone


def join_command(
    addresses: Sequence[str],
    script: str,
    config_path: str,
    overrides: Sequence[str] = (),
    auth_server: Optional[str] = None,
) -> str:
    """The command a volunteer on another machine pastes to join, from the root of their clone after
    ``bash scripts/setup_env.sh``: the clone's ``.venv`` Python, a config path inside the repository, the
    run-defining overrides the organiser used, and (in a moderated run) the authorization server."""
    parts = [VOLUNTEER_PYTHON, script, "--config", config_path]
    if auth_server is not None:
        parts += ["--auth-server", auth_server]
    parts += ["--initial-peers", *addresses, *overrides]
    return " ".join(shlex.quote(part) for part in parts)


def swarm_step_key(run_id: str) -> str:
    """Where peers that follow the global step without accumulating samples (auxiliary peers) announce it."""
    return f"{run_id}_swarm_step"


def announce_swarm_step(dht: hivemind.DHT, run_id: str, step: int, lifetime: float) -> None:
    """Announce the global step this peer follows, for ``lifetime`` seconds (signed: only we can replace it).

    hivemind's progress records come from peers that accumulate samples only, and a record outlives its peer by
    up to ``collaboration.progress_expiration`` (60 s): when every trainer has crashed, the swarm's step vanishes
    from the DHT that much later. This record keeps it while an auxiliary peer lives, so a newcomer still learns
    the step the swarm reached (``bound_state_downloads``)."""
    store_signed(dht, swarm_step_key(run_id), int(step), lifetime)


def store_signed(dht: hivemind.DHT, key: str, value, lifetime: float) -> None:
    """Store ``value`` under ``key`` for ``lifetime`` seconds in this peer's own subkey, signed with its key: other
    peers' records under the same key stay, and only this peer can replace its own. Does not wait for the store."""
    dht.store(
        key=key,
        subkey=RSASignatureValidator().local_public_key,
        value=value,
        expiration_time=get_dht_time() + lifetime,
        return_future=True,
    )


def read_announced_swarm_step(dht: hivemind.DHT, run_id: str, timeout: float = 5.0) -> int:
    """The highest global step a live auxiliary peer announced; -1 if none did or the DHT did not answer in time."""
    try:
        entry = dht.get(swarm_step_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    except Exception:  # a slow or ending DHT: no announcement is known
        return -1
    if entry is None or not isinstance(entry.value, dict):
        return -1
    steps = [item.value for item in entry.value.values() if isinstance(item.value, int) and item.value >= 0]
    return max(steps, default=-1)
