"""What every role does first: parse its command line, load the config, start its DHT node, announce itself."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import hivemind
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.auth import AuthorizerBase

from common.bandwidth import bandwidth_for_averager, measure_link_to_initial_peer, serve_bandwidth_probe
from common.config import RunConfig, load_config
from common.dht import join_command, start_dht, visible_multiaddrs
from common.metrics import make_validators

logger = logging.getLogger(__name__)

ADDRESS_FILE = "initial_peers.txt"  # a peer's multiaddrs, one per line, for launchers and volunteers


@dataclass
class RoleArguments:
    config: RunConfig
    config_path: str
    name: str
    auth_server: Optional[str] = None


def parse_role_arguments(role: str, argv: Optional[Sequence[str]] = None, moderated: bool = False) -> RoleArguments:
    """``moderated``: the role can join a moderated run (``--auth-server URL``; see common.auth.authorize)."""
    parser = argparse.ArgumentParser(description=f"DeDLOC {role} peer", allow_abbrev=False)
    if moderated:
        parser.add_argument("--auth-server", default=None, help="URL of scripts/auth_server.py (moderated runs)")
    parser.add_argument("--config", required=True, help="YAML file under configs/")
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=None,
        help="multiaddrs of any peer already in the swarm (printed by every running peer)",
    )
    parser.add_argument("--name", default=None, help="this peer's name in logs and the leaderboard")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. training.max_global_steps=20")
    args = parser.parse_args(argv)
    # argparse lets --initial-peers swallow the overrides that follow it: give them back
    peers = [item for item in args.initial_peers or [] if not _looks_like_override(item)]
    overrides = [item for item in args.initial_peers or [] if _looks_like_override(item)] + args.overrides
    config = load_config(args.config, overrides)
    if args.initial_peers is not None:
        config.network.initial_peers = peers
    return RoleArguments(
        config=config,
        config_path=args.config,
        name=args.name or role,
        auth_server=args.auth_server if moderated else None,
    )


def _looks_like_override(item: str) -> bool:
    return "=" in item and not item.startswith("/")


def link_bandwidth(dht: hivemind.DHT, config: RunConfig) -> Optional[float]:
    """The bandwidth to declare to hivemind's load balancer: measured against the first initial peer when
    ``collaboration.measure_bandwidth`` is set (and possible), else the configured figure."""
    collab = config.collaboration
    if not collab.measure_bandwidth or not config.network.initial_peers:
        return bandwidth_for_averager(collab.bandwidth, None)
    try:
        measurement = measure_link_to_initial_peer(
            dht, config.network.initial_peers[0], collab.bandwidth_probe_seconds
        )
    except Exception as error:  # a failed probe must not stop a volunteer from joining
        logger.warning(f"bandwidth measurement failed ({type(error).__name__}: {error}); using the declared value")
        measurement = None
    return bandwidth_for_averager(collab.bandwidth, measurement)


def device_for(config: RunConfig) -> torch.device:
    wanted = config.training.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(wanted)


def start_peer_dht(
    config: RunConfig,
    output_dir: Path,
    join_script: str,
    config_path: str,
    authorizer: Optional[AuthorizerBase] = None,
) -> hivemind.DHT:
    """Start the DHT with the metrics validators, write our addresses, and log the volunteer join command."""
    validators: List = make_validators(config.collaboration.run_id, RSASignatureValidator())
    dht = start_dht(config.network, validators, authorizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not config.network.client_mode:
        serve_bandwidth_probe(dht)  # joining peers may measure their link against us
        (output_dir / ADDRESS_FILE).write_text("\n".join(visible_multiaddrs(dht)) + "\n")
        logger.info(f"to join this run, a volunteer runs:\n  {join_command(dht, join_script, config_path)}")
    return dht
