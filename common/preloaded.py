"""Start peers from a process that has already imported torch, transformers and hivemind.

A peer process spends about 8 CPU-seconds (2 cores: 4-5 s of wall time) importing torch, transformers and
hivemind before it does anything. A local swarm starts the same scripts again and again (five peers, restarts
after faults), so ``LocalSwarm`` imports them once, in a *preloaded* process, and forks each peer from it: a
peer is still its own OS process with its own process group, sockets, DHT and p2p daemon, runs the same script
with the same arguments, environment, working folder and log file, and exits with the same code. Only the
imports are shared (copy-on-write), as ``multiprocessing``'s forkserver shares its preloaded modules.

A fork is safe here because the imports start no thread (the preloaded process reports its thread count and the
launcher refuses more than one): torch's thread pools, hivemind's DHT and the p2p daemon start later, in the peer.
What a fork would share that separate imports do not, the semaphores modules create at import, each peer makes
anew (``import_time_semaphores``).

A peer on an emulated host (``ip netns exec NAME python ...``) is forked too: it enters the network namespace
``NAME`` itself (``setns``) before its script runs, so its sockets and its p2p daemon live on that host.

Protocol (one JSON object per line): the launcher writes ``{"argv", "cwd", "env", "log", "netns"}`` to the
preloaded process's stdin; it answers ``{"started": pid}`` on stdout, and ``{"exited": pid, "returncode": code}`` (a
negative code for a signal, as ``subprocess``) when that peer ends. It reaps its peers, so their CPU time is
counted to it and, once it exits, to the launcher. A forked peer sets its process title to its own command line
(``python scripts/train.py --config ... --name ...``), so ``ps``, ``pgrep -af <folder>`` and psutil see it as
they see a peer started with ``exec``; the preloaded process's own command line names the swarm's folder.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import setproctitle

from common.lifecycle import die_with_parent

logger = logging.getLogger(__name__)

# what every peer imports; a run's experiment package (``<task_module>.task``) is added by the launcher
COMMON_MODULES = ("common.roles.trainer", "common.roles.monitor", "common.roles.auxiliary")
READY_SECONDS = 180.0  # the imports take 5-10 s on an idle machine, minutes on a loaded one


class PreloadedProcess:
    """The part of ``subprocess.Popen`` that launchers use, for a peer forked by the preloaded process."""

    def __init__(self, pid: int, args: List[str], launcher: "PreloadedLauncher"):
        self.pid, self.args, self._launcher = pid, args, launcher
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        with self._launcher.condition:
            if not self._launcher.condition.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedLauncher:
    """The launcher's side: starts the preloaded process, forks peers through it, tracks their exit codes."""

    def __init__(
        self,
        label: Path,
        modules: Sequence[str],
        environment: Dict[str, str],
        cwd: Path,
        preexec_fn: Optional[Callable[[], None]] = None,
    ):
        label.mkdir(parents=True, exist_ok=True)
        with (label / "preloaded.log").open("ab") as log:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "common.preloaded", str(label), *modules],
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=environment,
                start_new_session=True,  # a Ctrl-C in the launcher's terminal is for the peers to handle
                preexec_fn=preexec_fn,
            )
        self.condition = threading.Condition()
        self._started: "queue.Queue[Optional[PreloadedProcess]]" = queue.Queue()
        self._processes: Dict[int, PreloadedProcess] = {}
        self._pending_args: "queue.Queue[List[str]]" = queue.Queue()
        self._request_lock = threading.Lock()
        self._ready = threading.Event()
        self._ended = False
        self.threads_after_imports = 0
        self.unrenewable_semaphores: List[str] = []
        self.renewed_semaphores = 0
        self._reader = threading.Thread(target=self._read_replies, name="preloaded-replies", daemon=True)
        self._reader.start()
        if not self._ready.wait(READY_SECONDS):
            self.close()
            raise RuntimeError(f"the preloaded peer process did not finish its imports in {READY_SECONDS:.0f} s")
        if self._ended:
            self.close()
            raise RuntimeError(f"the preloaded peer process ended: {label / 'preloaded.log'}")
        if self.threads_after_imports != 1:
            self.close()
            raise RuntimeError(f"importing {', '.join(modules)} started threads: forking peers from it is unsafe")
        if self.unrenewable_semaphores:
            self.close()
            shared = ", ".join(self.unrenewable_semaphores)
            raise RuntimeError(f"importing {', '.join(modules)} created {shared}: the peers would share them")

    @property
    def alive(self) -> bool:
        return not self._ended and self.server.poll() is None

    def start(
        self,
        argv: List[str],
        cwd: Path,
        environment: Dict[str, str],
        log_path: Path,
        network_namespace: Optional[str] = None,
    ) -> PreloadedProcess:
        """Fork a peer running ``argv`` (``[python, script, *arguments]``, as for ``subprocess.Popen``), in the
        named network namespace (``ip netns``) if one is given."""
        request = {
            "argv": list(argv),
            "cwd": str(cwd),
            "env": environment,
            "log": str(log_path),
            "netns": network_namespace,
        }
        with self._request_lock:
            self._pending_args.put(list(argv))
            self.server.stdin.write(json.dumps(request).encode() + b"\n")
            self.server.stdin.flush()
            process = self._started.get(timeout=60)
        if process is None:
            raise RuntimeError("the preloaded peer process ended")
        return process

    def _read_replies(self) -> None:
        for line in self.server.stdout:
            reply = json.loads(line)
            if reply.get("ready"):
                self.threads_after_imports = reply["threads"]
                self.unrenewable_semaphores = reply["unrenewable"]
                self.renewed_semaphores = reply["semaphores"]
                self._ready.set()
            elif "started" in reply:
                process = PreloadedProcess(reply["started"], self._pending_args.get(), self)
                with self.condition:
                    self._processes[process.pid] = process
                self._started.put(process)
            elif "exited" in reply:
                with self.condition:
                    process = self._processes.pop(reply["exited"], None)
                    if process is not None:
                        process.returncode = reply["returncode"]
                    self.condition.notify_all()
        # the preloaded process ended: its peers got SIGTERM (parent-death signal); their exit codes are lost
        with self.condition:
            for process in self._processes.values():
                process.returncode = -signal.SIGTERM
            self._processes.clear()
            self.condition.notify_all()
        self._started.put(None)
        self._ended = True
        self._ready.set()  # wakes a launcher still waiting for the imports

    def close(self) -> None:
        """End the preloaded process (peers still running get SIGTERM from the kernel when it exits)."""
        try:
            self.server.stdin.close()
        except OSError:
            pass
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self._reader.join(timeout=10)


# ---- the preloaded process ------------------------------------------------------------------------------------


# What a module may create at import that the processes forked from one parent share: a POSIX semaphore. hivemind
# creates four (``MPFuture``'s initialization and update locks, ``SharedBytes._lock``, the process-wide executor's
# lock); shared by all peers, one peer SIGKILLed while holding one would block every other peer forever. A peer
# that imports hivemind itself has its own, so each forked peer gets new ones.
_RENEWABLE = {
    multiprocessing.synchronize.Lock: lambda old: multiprocessing.Lock(),
    multiprocessing.synchronize.RLock: lambda old: multiprocessing.RLock(),
}


def import_time_semaphores() -> List[Tuple[object, str]]:
    """``(owner, attribute)`` of each multiprocessing synchronization object held by a loaded module or by a class
    it defines."""
    found = []
    for module in list(sys.modules.values()):
        try:
            namespace = dict(vars(module))
        except TypeError:
            continue
        owners = [module] + [
            value
            for value in namespace.values()
            if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__
        ]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, (multiprocessing.synchronize.SemLock, multiprocessing.synchronize.Event)):
                    found.append((owner, name))
    return found


def _renew_semaphores(semaphores: Sequence[Tuple[object, str]]) -> None:
    for owner, name in semaphores:
        setattr(owner, name, _RENEWABLE[type(getattr(owner, name))](getattr(owner, name)))


def _reply(message: dict) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(1, data) :]


Semaphores = Sequence[Tuple[object, str]]


CLONE_NEWNET = 0x40000000  # from <sched.h>: setns joins the descriptor's network namespace


def _enter_network_namespace(name: str) -> None:
    """Move this (single-threaded) process into ``ip netns``'s namespace ``name``, as ``ip netns exec`` does for
    the command it runs; what it starts after (the p2p daemon) is born there. Needs CAP_SYS_ADMIN, as ``ip``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


def _run_peer(request: dict, server_pid: int, private_fds: Sequence[int], titled_fd: int, semaphores: Semaphores):
    """In the forked child: become the peer ``python <argv>`` would have been, then run its script. Never returns:
    the script's SystemExit (or the one raised here) unwinds to the interpreter, which exits as a script's does."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for descriptor in private_fds:
        os.close(descriptor)
    os.setsid()
    # what ps, pgrep and psutil show for this process: the command it stands for, not the preloaded process's
    # (before the environment changes: setproctitle makes room for the title in the original environment's memory)
    setproctitle.setproctitle(" ".join(request["argv"]))
    os.close(titled_fd)  # the launcher hands out the pid only now: whoever looks the peer up sees its command
    die_with_parent(server_pid)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    if request.get("netns"):  # an error unwinds to the interpreter: exit code 1, the traceback in the peer's log
        _enter_network_namespace(request["netns"])
    _renew_semaphores(semaphores)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # the generators a fresh interpreter would seed from the OS (Python's own `random` reseeds itself after a fork)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    _, script, *arguments = request["argv"]
    sys.argv = [script, *arguments]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def serve(modules: Sequence[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # a peer that needs it reports the error itself, in its own log
            sys.stderr.write(f"preloading {module} failed: {error!r}\n")
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup descriptor
    sys.stderr.flush()  # or every forked peer would write what is left in the buffer (import warnings) to its log
    semaphores = import_time_semaphores()
    kinds = {type(getattr(owner, name)).__name__ for owner, name in semaphores}
    unknown = sorted(kinds - {kind.__name__ for kind in _RENEWABLE})
    # forking is safe only while this process runs one thread (a lock held by another would stay held in the peer)
    # and every shared semaphore can be made anew
    _reply({"ready": True, "threads": threading.active_count(), "unrenewable": unknown, "semaphores": len(semaphores)})
    pending, children = b"", 0
    while True:
        readable, _, _ = select.select([0, wake_read], [], [], 5.0)
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children -= 1
            _reply({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if 0 in readable:
            data = os.read(0, 1 << 20)
            if not data:
                # the launcher closed the requests: it has stopped its peers, or it is gone and the peers still
                # running get SIGTERM as this process exits (their parent-death signal)
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                titled_read, titled_write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    _run_peer(request, os.getppid(), (wake_read, wake_write, titled_read), titled_write, semaphores)
                os.close(titled_write)
                os.read(titled_read, 1)  # end of file once the peer has its title (or has died)
                os.close(titled_read)
                children += 1
                _reply({"started": pid})


if __name__ == "__main__":
    # argv: the swarm's folder (only to name this process), then the modules to import
    serve(sys.argv[2:])
