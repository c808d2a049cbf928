"""Process lifecycle: logging set-up, SIGINT/SIGTERM turned into a graceful stop, thread limits."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM (a peer's graceful stop) when the thread that started this process dies; exit if
    the parent ``parent_pid`` is already gone. Linux only (elsewhere a launcher's peers outlive a SIGKILL of it).
    Called in a child between fork and exec, so it only calls functions resolved beforehand."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent_pid:
        os._exit(1)


class StopFlag:
    """Set by SIGINT/SIGTERM; loops poll it and shut down cleanly. A second signal exits at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: Optional[str] = None
        self._owner_pid = os.getpid()

    def install(self) -> "StopFlag":
        self._owner_pid = os.getpid()
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if os.getpid() != self._owner_pid:
            # A forked child (hivemind's DHT and averager processes) inherits this handler, but nothing there polls
            # the flag. Ctrl-C reaches the whole terminal's process group: the child ignores it, as the peer shuts
            # it down in order. SIGTERM comes from hivemind's shutdown when the child did not stop in time: it ends.
            if signum == signal.SIGTERM:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self._event.is_set():  # a second signal: the user wants out now
            if os.getpgrp() == os.getpid():
                # a peer started by the launcher leads its own process group: take its hivemind children (DHT,
                # averagers, p2pd) along, as nobody else may stop them (a SIGKILLed launcher's parent-death
                # signal arrives twice when the kernel reparents the peer to the dying launcher's other threads)
                os.killpg(os.getpid(), signal.SIGKILL)
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        logging.getLogger(__name__).info(f"received {self.signal_name}: finishing the current step and shutting down")
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)


def setup_logging(name: str, log_file: Optional[Path] = None, level: int = logging.INFO) -> None:
    handlers: list = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [{name}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        handlers=handlers,
        force=True,
    )
    # hivemind's own records are rewritten by the log policies of common.hivemind_patches, which start_dht installs
    for noisy in ("hivemind", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # hivemind.Optimizer's per-step status (how many peers each averaging round had, fallbacks to local gradients)
    # is what a volunteer needs to see; its progress tracker's sub-second refresh lines stay hidden
    for status_logger in ("hivemind.optim.optimizer", "hivemind.optim.state_averager"):
        logging.getLogger(status_logger).setLevel(logging.INFO)
