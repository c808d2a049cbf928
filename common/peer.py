"""What every role does first: parse its command line, load the config, start its DHT node, announce itself."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import hivemind
import yaml
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.auth import AuthorizerBase

from common import startup
from common.auth import authorize
from common.bandwidth import bandwidth_for_averager, measure_link_to_initial_peer, serve_bandwidth_probe
from common.config import CONFIG_KEYS_HELP, Backend, RunConfig, load_config, to_container, to_yaml
from common.dht import in_unrouted_range, join_command, listening_port, start_dht, store_signed, visible_multiaddrs
from common.hivemind_compat import sign_with_identity_key
from common.identity import IDENTITY_FILE, PeerIdentity, load_identity
from common.lifecycle import StopFlag, setup_logging
from common.metrics import make_validators

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
ADDRESS_FILE = "initial_peers.txt"  # a peer's multiaddrs, one per line, for launchers and volunteers
RESOLVED_CONFIG_FILE = "config.yaml"  # the config this peer runs with, every default and override resolved
JOIN_COMMAND_FILE = "join_command.txt"  # the command a volunteer pastes, as logged
PORT_FILE = "listen_port.txt"  # the port a peer listened on, reused after a restart (network.keep_port)
# what volunteers must share with the organiser: everything that defines the run rather than one peer's machine
RUN_WIDE_SECTIONS = ("task", "collaboration")
PER_PEER_COLLABORATION_KEYS = ("bandwidth", "measure_bandwidth", "bandwidth_probe_seconds")
RUN_WIDE_TRAINING_KEYS = ("max_global_steps", "seed")


@dataclass
class RoleArguments:
    config: RunConfig
    config_path: str
    name: str
    auth_server: Optional[str] = None
    auth_ca: Optional[str] = None  # the certificate to trust for the authorization server (self-signed ones)
    identity: Optional[PeerIdentity] = None  # None for a trainer that starts no DHT (single-process, DDP)
    name_given: bool = False  # False: ``name`` was derived from the peer id


def role_argument_parser(role: str, moderated: bool = False, volunteer: bool = False) -> argparse.ArgumentParser:
    """``moderated``: the role can join a moderated run (``--auth-server URL``; see common.auth.authorize).
    ``volunteer``: it must (``--auth-server`` required) and runs in client mode unless ``--server-mode``."""
    parser = argparse.ArgumentParser(description=f"DeDLOC {role} peer", allow_abbrev=False, epilog=CONFIG_KEYS_HELP)
    if moderated or volunteer:
        parser.add_argument(
            "--auth-server",
            required=volunteer,
            default=None,
            help="https:// URL of scripts/auth_server.py (a moderated run); credentials come from $DEDLOC_USERNAME / "
            "$DEDLOC_PASSWORD or a prompt",
        )
        parser.add_argument(
            "--auth-ca",
            default=None,
            help="the authorization server's certificate file, if self-signed (default: this machine's trusted CAs)",
        )
    if volunteer:
        parser.add_argument(
            "--server-mode",
            action="store_true",
            help="accept inbound connections (only if this machine is reachable; default: client mode)",
        )
    parser.add_argument("--config", required=True, help="YAML file under configs/")
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=None,
        help="multiaddrs of any peer already in the swarm (printed by every running peer)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="a display name for logs and the leaderboard (default: derived from this peer's id; names may "
        "repeat, a contributor is its peer id, kept in network.identity_path)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. training.max_global_steps=20")
    return parser


def parse_role_arguments(
    role: str, argv: Optional[Sequence[str]] = None, moderated: bool = False, volunteer: bool = False
) -> RoleArguments:
    """Parse the command line, load the config and this peer's identity (creating it on first start)."""
    startup.mark("imports")
    args = role_argument_parser(role, moderated, volunteer).parse_args(argv)
    # argparse lets --initial-peers swallow the overrides that follow it: give them back
    peers = [item for item in args.initial_peers or [] if not _looks_like_override(item)]
    overrides = [item for item in args.initial_peers or [] if _looks_like_override(item)] + args.overrides
    config = load_config(args.config, overrides)
    if args.initial_peers is not None:
        config.network.initial_peers = peers
    if volunteer:
        config.network.client_mode = not args.server_mode
    identity = None
    if role != "trainer" or config.training.backend == Backend.collaborative:
        if config.network.identity_path is None:
            config.network.identity_path = str(Path(config.training.output_dir) / IDENTITY_FILE)
        identity = load_identity(config.network.identity_path)
        sign_with_identity_key(identity.private_key)  # before any hivemind signer or authorizer is built
    name = args.name or (identity.default_name(role) if identity is not None else role)
    startup.mark("config and identity")
    return RoleArguments(
        config=config,
        config_path=args.config,
        name=name,
        auth_server=getattr(args, "auth_server", None),
        auth_ca=getattr(args, "auth_ca", None),
        identity=identity,
        name_given=args.name is not None,
    )


def run_moderated_role(role: str, run: Callable[..., None]) -> None:
    """The command line of a peer that may serve a moderated run (``monitor``, ``auxiliary``): SIGINT/SIGTERM stop
    it cleanly, its arguments, config and identity are read, its log lines carry its name, and with ``--auth-server``
    it signs in before ``run(config, config_path, stop, authorizer)`` plays the role (authorizer None otherwise)."""
    stop = StopFlag().install()
    args = parse_role_arguments(role, moderated=True)
    setup_logging(args.name)
    run(args.config, args.config_path, stop, authorize(args.auth_server, args.auth_ca))


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


def start_peer_dht(
    config: RunConfig,
    output_dir: Path,
    join_script: str,
    config_path: str,
    authorizer: Optional[AuthorizerBase] = None,
    stop: Optional[StopFlag] = None,
) -> hivemind.DHT:
    """Start the DHT with the metrics validators, save the resolved config, write our addresses, and log the
    command a volunteer on another machine pastes to join (the volunteer command in a moderated run)."""
    validators: List = make_validators(config.collaboration.run_id, RSASignatureValidator())
    keeps_port = config.network.keep_port and not config.network.client_mode and not config.network.announce_maddrs
    dht = start_dht(
        config.network, validators, authorizer, kept_port=read_kept_port(output_dir) if keeps_port else None, stop=stop
    )
    startup.mark("DHT bootstrap")
    logger.info(f"peer id {dht.peer_id} (identity {config.network.identity_path})")
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RESOLVED_CONFIG_FILE).write_text(to_yaml(config))
    port = listening_port(dht) if keeps_port else None
    if port is not None:
        (output_dir / PORT_FILE).write_text(f"{port}\n")
    if not config.network.client_mode:
        serve_bandwidth_probe(dht)  # joining peers may measure their link against us
        addresses = visible_multiaddrs(dht)
        if addresses and all(in_unrouted_range(address) for address in addresses):
            # peers on this machine can still join through loopback, which libp2p routes
            loopback = [str(address) for address in dht.get_visible_maddrs() if "/ip4/127." in str(address)]
            (output_dir / ADDRESS_FILE).write_text("\n".join(addresses + loopback) + "\n")
        else:
            (output_dir / ADDRESS_FILE).write_text("\n".join(addresses) + "\n")
        write_join_command(output_dir, config, config_path, join_script, addresses, authorizer)
    return dht


def write_join_command(
    output_dir: Path,
    config: RunConfig,
    config_path: str,
    join_script: str,
    addresses: Sequence[str],
    authorizer: Optional[AuthorizerBase] = None,
    entry_addresses: Sequence[str] = (),
) -> Optional[List[str]]:
    """Write (and log) the lines a volunteer pastes: the clone of this code, then the join command through this
    peer's ``addresses`` and other entry peers' ``entry_addresses``. None, with one WARNING line, when this peer's
    addresses are all in ranges through which volunteers cannot find each other."""
    if addresses and all(in_unrouted_range(address) for address in addresses):
        (output_dir / JOIN_COMMAND_FILE).unlink(missing_ok=True)  # a previous run's command may be stale
        logger.warning(
            f"no join command: this peer's only addresses for other machines ({', '.join(addresses)}) are in "
            f"ranges reserved for documentation or benchmarks, through which volunteers cannot find each other; "
            f"announce an address they can dial: network.announce_maddrs='[/ip4/PUBLIC_OR_PRIVATE_IP/tcp/PORT]' "
            f"with network.host_maddrs='[/ip4/0.0.0.0/tcp/PORT]'"
        )
        return None
    server_url = getattr(authorizer, "server_url", None)
    command = join_command(
        [*addresses, *(address for address in entry_addresses if address not in addresses)],
        "scripts/volunteer.py" if server_url else join_script,
        portable_config_path(config_path),
        run_overrides(config, config_path),
        server_url,
    )
    clone = clone_command()
    lines = [command] if clone is None else [clone, command]
    partial = output_dir / f"{JOIN_COMMAND_FILE}.partial"  # replaced whole: readers never see it half-written
    partial.write_text("\n".join(lines) + "\n")
    os.replace(partial, output_dir / JOIN_COMMAND_FILE)
    where = "from a clone of this repository" if clone is None else "the first line gets this code"
    logger.info(f"to join this run, a volunteer runs ({where}):\n  " + "\n  ".join(lines))
    return lines


def entry_peers_key(run_id: str) -> str:
    """Where peers that accept connections for the whole run (auxiliary peers) announce their addresses."""
    return f"{run_id}_entry_peers"


def announce_entry_peer(dht: hivemind.DHT, run_id: str, addresses: Sequence[str], lifetime: float) -> None:
    """Announce ``addresses`` as a way into the run for ``lifetime`` seconds (signed: only we can replace them)."""
    store_signed(dht, entry_peers_key(run_id), list(addresses), lifetime)


def read_entry_peers(dht: hivemind.DHT, run_id: str, timeout: float = 10.0) -> List[str]:
    """The addresses the run's live entry peers announced (none if the DHT does not answer in ``timeout`` s)."""
    try:
        entry = dht.get(entry_peers_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    except Exception as error:  # a slow or ending DHT: the join command keeps the addresses it had
        logger.info(f"could not read the entry peers ({type(error).__name__}); keeping the join command")
        return []
    if entry is None or not isinstance(entry.value, dict):
        return []
    found = []
    for item in entry.value.values():
        if isinstance(item.value, list):
            found += [address for address in item.value if isinstance(address, str) and address.startswith("/")]
    return sorted(set(found))


CLONE_FOLDER = "dedloc"


def clone_command() -> Optional[str]:
    """The shell line that gets this repository at the commit this peer runs (volunteers run the same code and
    configs): from the ``origin`` remote, else from this folder's path (only on this machine or a shared file
    system: say so). None, with a WARNING, when this is not a git checkout."""

    def git(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *arguments], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            raise OSError(head.stderr.strip().splitlines()[-1] if head.stderr.strip() else "git rev-parse failed")
        remote = git("remote", "get-url", "origin")
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning(f"{ROOT} is not a git checkout ({error}): volunteers need a copy of this folder")
        return None
    source = remote.stdout.strip() if remote.returncode == 0 and remote.stdout.strip() else str(ROOT)
    if source == str(ROOT):
        logger.warning(
            f"this repository has no 'origin' remote: the join command clones {ROOT}, which only this machine can "
            f"read; publish the repository and add it (git remote add origin URL)"
        )
    if dirty:
        logger.warning("this repository has uncommitted changes: volunteers' clones get the last commit without them")
    commit = head.stdout.strip()
    return f"git clone {shlex.quote(source)} {CLONE_FOLDER} && cd {CLONE_FOLDER} && git checkout --quiet {commit}"


def read_kept_port(output_dir: Path) -> Optional[int]:
    """The port this peer listened on in its previous run in ``output_dir`` (None: first start, or unreadable)."""
    path = output_dir / PORT_FILE
    if not path.exists():
        return None
    try:
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        port = 0
    if not 0 < port < 65536:
        logger.warning(f"{path} does not hold a port number: listening on a new port")
        return None
    return port


def read_join_command(output_dir: Path) -> str:
    """The join command a peer logged (``start_peer_dht``); empty for a client-mode peer, which prints none."""
    path = output_dir / JOIN_COMMAND_FILE
    return path.read_text().strip() if path.exists() else ""


def portable_config_path(config_path: str) -> str:
    """The config path relative to the repository root (volunteers run from their own clone)."""
    path = Path(config_path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        logger.warning(f"config {config_path} is outside the repository: volunteers need a copy at the same path")
        return config_path


def run_overrides(config: RunConfig, config_path: str) -> List[str]:
    """The ``key=value`` overrides that make the config file into this run: run-wide keys only (task,
    collaboration, step budget, seed), never this peer's machine, addresses or folders."""
    base, current = _flatten(to_container(load_config(config_path))), _flatten(to_container(config))
    overrides = []
    for key, value in current.items():
        section, _, leaf = key.partition(".")
        run_wide = (section in RUN_WIDE_SECTIONS and leaf not in PER_PEER_COLLABORATION_KEYS) or key in {
            f"training.{name}" for name in RUN_WIDE_TRAINING_KEYS
        }
        if run_wide and base.get(key) != value:
            overrides.append(f"{key}={_dotlist_value(value)}")
    return overrides


def _flatten(container: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in container.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _dotlist_value(value) -> str:
    """A value as an override's right-hand side (YAML flow style, as omegaconf parses it back)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text
