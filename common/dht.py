"""Starting a hivemind DHT node from config, with clear errors and the join command for the next volunteer."""

from __future__ import annotations

import ipaddress
import logging
import shlex
from typing import List, Optional, Sequence

import hivemind
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.multiaddr import Multiaddr

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
    return dht


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


def join_command(
    addresses: Sequence[str],
    script: str,
    config_path: str,
    overrides: Sequence[str] = (),
    auth_server: Optional[str] = None,
) -> str:
    """The command a volunteer on another machine pastes to join: ``python`` (theirs, not ours), a config path
    inside the repository, the run-defining overrides the organiser used, and (in a moderated run) the
    authorization server."""
    parts = ["python", script, "--config", config_path]
    if auth_server is not None:
        parts += ["--auth-server", auth_server]
    parts += ["--initial-peers", *addresses, *overrides]
    return " ".join(shlex.quote(part) for part in parts)
