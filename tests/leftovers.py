"""A check that a test shuts down every in-process hivemind object it built: nothing it started is left behind.

A module uses it with ``from tests.leftovers import leaves_nothing_behind`` and
``pytestmark = pytest.mark.usefixtures("leaves_nothing_behind")``. What it catches is what made tests fail far away
from their cause: an event loop dropped with tasks still pending (asyncio logs "Task was destroyed but it is
pending!" whenever the garbage collector gets to it, in another test or at exit), a thread still running (a
progress tracker, an averager's state server) and a child process still alive (a DHT, an averager, a p2p daemon).
It costs a garbage collection per test (about 0.2-1 s here), so it is for tests that build hivemind objects in the
test process, not for the whole suite.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from multiprocessing import resource_sharer
from typing import List

import psutil
import pytest
from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture

GRACE_SECONDS = 10.0  # how long a thread or process that was told to stop may take to end after the test
DESTROYED_PENDING = "Task was destroyed but it is pending"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if DESTROYED_PENDING in message:
            self.messages.append(message.replace("\n", " "))


def _process_wide(thread: threading.Thread) -> bool:
    """Threads started once per process and kept on purpose: hivemind's MPFuture receiver and executor for locks,
    the server that hands file descriptors to other processes (multiprocessing's resource sharer)."""
    lock_executor = _AsyncContextWrapper.CONTEXT_EXECUTOR
    sharer = getattr(resource_sharer._resource_sharer, "_thread", None)
    return (
        thread is MPFuture._pipe_waiter_thread
        or thread is sharer
        or (lock_executor is not None and thread in lock_executor._threads)
    )


def _process_wide_child(child: psutil.Process) -> bool:
    """torch's shared-memory manager: one per process, started by the first tensor shared with another process."""
    try:
        return child.name() == "torch_shm_manager"
    except psutil.Error:
        return False


def _still_running(child: psutil.Process) -> bool:
    try:
        return child.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # it ended since it was listed
        return False


def _command(child: psutil.Process) -> str:
    try:
        return " ".join(child.cmdline()[:3])
    except psutil.Error:
        return "ended while being named"


@pytest.fixture
def leaves_nothing_behind():
    me = psutil.Process()
    threads_before = set(threading.enumerate())
    children_before = {child.pid for child in me.children(recursive=True)}
    records = _Records()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(records)
    try:
        yield
        gc.collect()  # what the test dropped (an executor, a loop) ends its threads and tasks as it is collected
        deadline = time.monotonic() + GRACE_SECONDS
        while True:
            threads = [
                thread
                for thread in threading.enumerate()
                if thread not in threads_before and thread.is_alive() and not _process_wide(thread)
            ]
            children = [child for child in me.children(recursive=True) if child.pid not in children_before]
            children = [child for child in children if _still_running(child) and not _process_wide_child(child)]
            if not (threads or children) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        gc.collect()  # a loop dropped meanwhile reports its pending tasks as it is collected
        left = [f"thread {thread.name}" for thread in threads]
        left += [f"process {child.pid} ({_command(child)})" for child in children]
        left += [f"asyncio: {message}" for message in records.messages]
        assert not left, "the test left behind: " + "; ".join(left)
    finally:
        asyncio_logger.removeHandler(records)
