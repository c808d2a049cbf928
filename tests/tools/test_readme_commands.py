"""The README's commands work as printed, in a fresh shell (no activated environment, nothing on PATH but the
system's), from the root of a clone after set-up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import List

import pytest

from tests.helpers import ROOT, read_jsonl

FRESH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
NOISE = ("Traceback", "[ERROR]", " ERROR ", "ModuleNotFoundError")


def readme_blocks() -> List[List[str]]:
    """Each ```bash block of the README as its commands (continuation lines joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
        commands.append([" ".join(line.split()) for line in lines if line and not line.startswith("#")])
    return commands


def readme_commands() -> List[str]:
    """Every command the README shows: its bash blocks and the inline commands that start with the environment."""
    inline = re.findall(r"`(\.venv/bin/[^`]+)`", (ROOT / "README.md").read_text())
    return [command for block in readme_blocks() for command in block] + inline


def fresh_shell(command: str, cwd: Path, log: Path) -> subprocess.Popen:
    with log.open("wb") as handle:
        return subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=cwd,
            env=FRESH_ENV,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def test_every_python_entry_point_the_readme_shows_starts_in_a_fresh_shell(tmp_path):
    scripts = sorted({match for command in readme_commands() for match in re.findall(r"scripts/\w+\.py", command)})
    assert {"scripts/monitor.py", "scripts/train.py", "scripts/aux_peer.py"} <= set(scripts), scripts
    interpreters = {command.split()[0] for command in readme_commands() if command.startswith(".venv/")}
    assert interpreters <= {".venv/bin/python", ".venv/bin/torchrun"}, interpreters
    for script in scripts:
        log = tmp_path / (Path(script).stem + ".log")
        process = fresh_shell(f".venv/bin/python {script} --help", ROOT, log)
        assert process.wait(timeout=120) == 0, log.read_text()[-2000:]
        assert not any(marker in log.read_text() for marker in NOISE), log.read_text()[-2000:]


def wait_while_running(processes: dict, condition, seconds: float, log: Path) -> None:
    """Until ``condition()`` holds, for at most ``seconds``, while every process keeps running."""
    deadline = time.monotonic() + seconds
    while not condition():
        for name, process in processes.items():
            assert process.poll() is None, f"{name} exited: " + log.with_name(f"{name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_collaboration_block_runs_verbatim(tmp_path):
    """The README's "Running a real collaboration" block, line by line as printed, in a folder laid out like a
    clone (the repository's files linked, its own outputs/): the monitor starts, a trainer and an auxiliary peer
    join through the addresses it wrote, the swarm takes a global step, and every peer stops cleanly on SIGTERM."""
    block = next(block for block in readme_blocks() if any("scripts/monitor.py" in line for line in block))
    assert [line.split()[1] for line in block] == ["scripts/monitor.py", "scripts/train.py", "scripts/aux_peer.py"]
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in (".venv", ".cache", "scripts", "configs"):
        (clone / name).symlink_to(ROOT / name)
    processes = {}
    try:
        processes["monitor"] = fresh_shell(block[0], clone, tmp_path / "monitor.log")
        addresses = clone / "outputs/albert_tiny/initial_peers.txt"
        deadline = time.monotonic() + 150
        while not addresses.exists() and time.monotonic() < deadline:
            assert processes["monitor"].poll() is None, (tmp_path / "monitor.log").read_text()[-3000:]
            time.sleep(1)
        assert addresses.exists(), (tmp_path / "monitor.log").read_text()[-3000:]
        processes["trainer"] = fresh_shell(block[1], clone, tmp_path / "trainer.log")
        processes["aux"] = fresh_shell(block[2], clone, tmp_path / "aux.log")
        # The block's one trainer expects no other (collaboration.expected_peers=1): it passes the start barrier as
        # soon as it sees itself, after building its examples if no earlier test did
        trainer_log = tmp_path / "trainer.log"
        wait_while_running(
            processes,
            lambda: re.search("start barrier (passed|timed out)", trainer_log.read_text(errors="replace")),
            300,
            trainer_log,
        )
        assert "start barrier passed: 1 trainers visible" in trainer_log.read_text(errors="replace")
        history = clone / "outputs/albert_tiny/history.jsonl"
        wait_while_running(processes, lambda: bool(read_jsonl(history)), 240, trainer_log)
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        codes = {name: process.wait(timeout=60) for name, process in processes.items()}
    assert codes == {"monitor": 0, "trainer": 0, "aux": 0}, codes
    for name in processes:
        log = (tmp_path / f"{name}.log").read_text()
        assert not any(marker in log for marker in NOISE), f"{name}: {log[-3000:]}"
