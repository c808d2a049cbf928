"""A local swarm: every peer is its own OS process (own process group), talking to the others through hivemind.

Used by ``scripts/local_swarm.py``, the experiment scripts and the multi-peer tests. Every process started
here is stopped here: SIGTERM to the peer first (it shuts its optimizer and DHT down), then SIGKILL to its
whole process group, so no DHT process or p2pd daemon outlives the swarm. A launcher that is itself killed
(SIGKILL, OOM) cannot clean up; on Linux its peers then get SIGTERM from the kernel (parent-death signal).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from common.errors import PeerError
from common.lifecycle import die_with_parent
from common.peer import ADDRESS_FILE
from common.preloaded import COMMON_MODULES, PreloadedLauncher

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
ROLE_SCRIPTS = {"monitor": "scripts/monitor.py", "trainer": "scripts/train.py", "auxiliary": "scripts/aux_peer.py"}


def trainer_stop_seconds(averaging_timeout: float) -> float:
    """How long a trainer may take to exit after SIGTERM: it finishes its step, whose averaging round may wait
    ``averaging_timeout`` for partners that are being stopped too, then hivemind's shutdown waits as long again for
    its scheduled parameter round; exporting the model and stopping the DHT take the rest (a busy machine, a
    sahajBERT-sized model: up to a minute). A launcher that SIGKILLs a trainer sooner cuts a clean shutdown short."""
    return 2 * averaging_timeout + 90.0


def _terminate_with_launcher(launcher_pid: int) -> Callable[[], None]:
    """``preexec_fn``: the kernel sends the peer SIGTERM -- its graceful shutdown -- when the launcher's thread that
    started it dies."""
    return lambda: die_with_parent(launcher_pid)


@dataclass
class PeerProcess:
    name: str
    role: str
    output_dir: Path
    process: subprocess.Popen
    started: float = field(default_factory=time.time)

    @property
    def log_path(self) -> Path:
        return self.output_dir / "peer.log"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_process_group(
    process: subprocess.Popen, graceful: bool = True, grace_seconds: float = 20.0, already_signalled: bool = False
) -> None:
    """SIGTERM the peer (graceful) and wait, then SIGKILL whatever is left of its process group.

    A peer treats a second SIGTERM as "exit now", so ``already_signalled`` peers are only waited for.
    """
    pgid = process.pid  # started with start_new_session=True: the peer leads its own group
    if graceful and process.poll() is None:
        try:
            if not already_signalled:
                process.send_signal(signal.SIGTERM)
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            logger.warning(f"process {process.pid} ignored SIGTERM for {grace_seconds:.0f} s: killing its group")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while _group_alive(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        logger.error(f"process {process.pid} did not exit after SIGKILL")


LOOPBACK_LISTEN = "network.host_maddrs=[/ip4/127.0.0.1/tcp/0]"


def _task_modules(config_path: str) -> List[str]:
    """The run's experiment module, to import before the peers fork; none if the config cannot be read (each peer
    then reports that itself)."""
    try:
        task_module = OmegaConf.load(ROOT / config_path).get("task_module")
    except Exception:
        return []
    return [f"{task_module}.task"] if isinstance(task_module, str) and task_module.isidentifier() else []


class LocalSwarm:
    """Starts and stops peers of one run; use as a context manager so everything is cleaned up."""

    def __init__(
        self,
        config_path: str,
        output_dir: Path,
        overrides: Sequence[str] = (),
        command_prefix: Optional[Callable[[str], List[str]]] = None,
        host_overrides: Optional[Callable[[str], List[str]]] = None,
        environment: Optional[Dict[str, str]] = None,
        preload: bool = True,
    ):
        self.config_path, self.output_dir, self.overrides = config_path, Path(output_dir), list(overrides)
        self.command_prefix = command_prefix  # e.g. ["ip", "netns", "exec", ns] to place a peer in a namespace
        self.host_overrides = host_overrides  # e.g. network.host_maddrs for that namespace's address
        self.environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(environment or {})}
        self.peers: Dict[str, PeerProcess] = {}
        self.initial_peers: List[str] = []
        # peers are forked from one process that imported torch and hivemind once (common/preloaded.py), those
        # on an emulated host too (they enter its network namespace); another command prefix needs an interpreter
        self.preload = preload
        self._launcher: Optional[PreloadedLauncher] = None

    def _preloaded(self) -> PreloadedLauncher:
        if self._launcher is None or not self._launcher.alive:
            self._launcher = PreloadedLauncher(
                self.output_dir,
                [*COMMON_MODULES, *_task_modules(self.config_path)],
                self.environment,
                ROOT,
                preexec_fn=_terminate_with_launcher(os.getpid()),
            )
        return self._launcher

    def __enter__(self) -> "LocalSwarm":
        self.output_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(
        self, role: str, name: str, extra_overrides: Sequence[str] = (), initial_peers: bool = True
    ) -> PeerProcess:
        if name in self.peers and self.peers[name].alive():
            raise ValueError(f"peer {name} is already running")
        output_dir = self.output_dir / name
        output_dir.mkdir(parents=True, exist_ok=True)
        prefix = self.command_prefix(name) if self.command_prefix else []
        command = [
            *prefix,
            sys.executable,
            str(ROOT / ROLE_SCRIPTS[role]),
            "--config",
            self.config_path,
            "--name",
            name,
        ]
        if initial_peers and self.initial_peers:
            command += ["--initial-peers", *self.initial_peers]
        command += [
            # every peer of a local swarm is on this machine: loopback keeps it private (a config's default,
            # all interfaces, is for real runs); emulated hosts and explicit overrides below take precedence
            *([] if self.host_overrides else [LOOPBACK_LISTEN]),
            *self.overrides,
            f"training.output_dir={output_dir}",
            *(self.host_overrides(name) if self.host_overrides else []),
            *extra_overrides,
        ]
        process = None
        namespace = prefix[3] if len(prefix) == 4 and prefix[:3] == ["ip", "netns", "exec"] else None
        if (not prefix or namespace) and self.preload:
            try:
                process = self._preloaded().start(
                    command[len(prefix) :], ROOT, self.environment, output_dir / "peer.log", namespace
                )
            except RuntimeError as error:
                logger.warning(f"{error}; starting each peer in an interpreter of its own")
                self.preload = False
        if process is None:
            with (output_dir / "peer.log").open("ab") as log:
                process = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.environment,
                    start_new_session=True,
                    preexec_fn=_terminate_with_launcher(os.getpid()),
                )
        peer = PeerProcess(name=name, role=role, output_dir=output_dir, process=process)
        self.peers[name] = peer
        logger.info(f"started {role} {name} (pid {process.pid})")
        return peer

    def start_first_peer(
        self, role: str = "monitor", name: str = "monitor", extra_overrides: Sequence[str] = (), timeout: float = 120.0
    ) -> PeerProcess:
        """Start the bootstrap peer and wait for its multiaddrs; later peers join through them."""
        address_file = self.output_dir / name / ADDRESS_FILE
        address_file.unlink(missing_ok=True)
        peer = self.start(role, name, extra_overrides, initial_peers=False)
        deadline = time.monotonic() + timeout
        while not address_file.exists() or not address_file.read_text().strip():
            if not peer.alive():
                raise PeerError(f"{role} {name} exited before announcing its address: {peer.log_tail(3)}")
            if time.monotonic() > deadline:
                raise PeerError(f"{role} {name} did not announce its address within {timeout:.0f} s")
            time.sleep(0.2)
        self.initial_peers = address_file.read_text().split()
        return peer

    def stop(self, name: str, graceful: bool = True, grace_seconds: float = 20.0) -> None:
        self.stop_many([name], graceful=graceful, grace_seconds=grace_seconds)

    def stop_many(self, names: Sequence[str], graceful: bool = True, grace_seconds: float = 20.0) -> None:
        """SIGTERM all named peers at once (or SIGKILL their groups at once), then reap each."""
        peers = [self.peers[name] for name in names]
        if graceful:
            for peer in peers:
                if peer.alive():
                    peer.process.send_signal(signal.SIGTERM)
        else:
            for peer in peers:
                try:
                    os.killpg(peer.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_seconds
        for peer in peers:
            stop_process_group(
                peer.process,
                graceful=graceful,
                grace_seconds=max(0.1, deadline - time.monotonic()),
                already_signalled=graceful,
            )
            logger.info(
                f"stopped {peer.role} {peer.name} ({'SIGTERM' if graceful else 'SIGKILL'}), exit code "
                f"{peer.process.returncode}"
            )

    def wait(
        self,
        names: Sequence[str],
        timeout: float,
        on_tick: Optional[Callable[[], None]] = None,
        tick_seconds: float = 10.0,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> bool:
        """Wait until the named peers exit; False if the deadline passed (or ``should_stop``) first."""
        deadline, last_tick = time.monotonic() + timeout, time.monotonic()
        while any(self.peers[name].alive() for name in names):
            if time.monotonic() > deadline or should_stop():
                return False
            if on_tick is not None and time.monotonic() - last_tick >= tick_seconds:
                on_tick()
                last_tick = time.monotonic()
            time.sleep(0.5)
        return True

    def close(self) -> None:
        leftovers = [name for name, peer in self.peers.items() if peer.alive() or _group_alive(peer.process.pid)]
        if leftovers:
            self.stop_many(leftovers, graceful=True, grace_seconds=15.0)
        if self._launcher is not None:
            self._launcher.close()
            self._launcher = None
