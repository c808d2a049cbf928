"""Starting a hivemind DHT node from config, with clear errors and the join command for the next volunteer."""

from __future__ import annotations

import ipaddress
import logging
import shlex
from typing import List, Optional, Sequence, Union

import hivemind
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.multiaddr import Multiaddr

from common.config import NetworkConfig
from common.errors import PeerError
from common.hivemind_compat import (
    close_averager_p2p_on_shutdown,
    deliver_whole_streams,
    finish_abandoned_executor_maps,
    keep_inbound_stream_handlers_alive,
)

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


def start_dht(
    network: NetworkConfig, record_validators: Sequence = (), authorizer: Optional[AuthorizerBase] = None
) -> hivemind.DHT:
    """Start this process's DHT node (must run in the main thread: hivemind requires it). With an ``authorizer``
    (``common.auth``), DHT requests and responses carry access tokens and unauthorized peers are refused."""
    initial_peers = validate_multiaddrs(network.initial_peers, "initial peer")
    validate_multiaddrs(network.host_maddrs, "host")
    validate_multiaddrs(network.announce_maddrs, "announce")
    if network.client_mode and not initial_peers:
        raise PeerError(
            "a client-mode peer accepts no inbound connections, so it cannot start a swarm: "
            "give network.initial_peers of a peer that is not in client mode"
        )
    # before the DHT's process (and later the averagers') is forked
    keep_inbound_stream_handlers_alive()
    deliver_whole_streams()
    close_averager_p2p_on_shutdown()
    finish_abandoned_executor_maps()
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=list(network.host_maddrs),
            announce_maddrs=list(network.announce_maddrs) or None,
            client_mode=network.client_mode,
            identity_path=network.identity_path,
            use_relay=network.use_relay,
            use_auto_relay=network.use_auto_relay,
            record_validators=list(record_validators),
            bootstrap_timeout=network.bootstrap_timeout,
            authorizer=authorizer,
            startup_timeout=network.bootstrap_timeout,
            start=True,
        )
    except (P2PDaemonError, RuntimeError, TimeoutError, OSError) as error:
        detail = " ".join(str(error).split())[:300]
        raise PeerError(f"could not start the DHT node or reach initial peers {initial_peers}: {detail}") from None
    try:
        connected = not initial_peers or dht.run_coroutine(_count_neighbours) > 0
    except BaseException:
        dht.shutdown()
        raise
    if not connected:
        dht.shutdown()
        raise PeerError(
            f"no initial peer answered as a DHT server within {network.bootstrap_timeout:.0f} s "
            f"(unreachable, or every peer is in client mode): {initial_peers}"
        )
    problem = unrouted_addresses_problem(initial_peers if initial_peers else visible_multiaddrs(dht))
    if problem is not None:
        logger.warning(problem)
    return dht


# Address ranges reserved for documentation and benchmarks (RFC 5737, RFC 2544). The peer routing of p2pd (libp2p's
# Kademlia DHT) never adds a peer connected through such an address to its routing table, so no third peer can
# find it by peer id: every p2p stream to it fails with "routing: not found" and it averages with nobody, although
# hivemind's own DHT (reached through the directly dialled initial peer) works. Checked with three p2pd daemons in
# a network namespace per range, the third dialling the second by id after both joined through the first: these
# four fail; 10/8, 172.16/12, 192.168/16, 100.64/10, loopback and a public address work.
UNROUTED_BY_LIBP2P = tuple(
    ipaddress.ip_network(block) for block in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15")
)


def unrouted_addresses_problem(addresses: Sequence[str]) -> Optional[str]:
    """A warning when the swarm would be joined through ``addresses`` (the initial peers, or this peer's own for the
    first peer) and every IP address among them is one libp2p's peer routing ignores; None otherwise."""
    ips = [_ip_of(address) for address in addresses]
    ips = [ip for ip in ips if ip is not None]
    if not ips or not all(any(ip in block for block in UNROUTED_BY_LIBP2P) for ip in ips):
        return None
    return (
        f"the swarm is joined through {', '.join(str(ip) for ip in ips)}, in a range reserved for documentation "
        f"or benchmarks that libp2p's peer routing ignores: peers will not find each other by peer id (\"routing: "
        f'not found") and gradient averaging will find no group. On one machine listen on loopback '
        f"(network.host_maddrs=[/ip4/127.0.0.1/tcp/0]) and join through the loopback address; across machines use "
        f"private or public addresses (network.announce_maddrs)"
    )


def _ip_of(address: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    parsed = Multiaddr(address)
    for family in ("ip4", "ip6"):
        if family in [protocol.name for protocol in parsed.protocols()]:
            return ipaddress.ip_address(parsed.value_for_protocol(family))
    return None


async def _count_neighbours(_dht, node) -> int:
    return sum(len(bucket.nodes_to_peer_id) for bucket in node.protocol.routing_table.buckets)


def _has_neighbours(dht: hivemind.DHT) -> bool:
    # run_coroutine pickles the coroutine function to the DHT process: it must be a module-level function
    return dht.run_coroutine(_count_neighbours) > 0


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
