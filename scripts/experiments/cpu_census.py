"""Where a multi-peer test spends the machine's CPU: each process it starts, by kind, sampled from /proc.

Runs one pytest selection in one process and, every half second, reads the CPU seconds of every process whose
command line names the run's folder (the peers) and of their children (hivemind's DHT and averager processes are
forked peers: same command line, the peer as parent; each DHT process starts a p2p daemon, ``p2pd``). The peak per
process is its CPU; a process that lives under half a second may be missed. Writes a JSON artefact with the totals
per kind, each peer's main / DHT / averagers / p2pd split, the pytest outcome, command, machine, date and load.

    python scripts/experiments/cpu_census.py \
        tests/core/test_swarm.py::test_three_trainers_aux_and_monitor_train_together \
        --out paper_results/core/cpu_census_three_trainers.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common.errors import exit_on_user_error
from common.lifecycle import StopFlag, setup_logging
from common.tools.provenance import ROOT, git_commit, machine_description

logger = logging.getLogger("cpu_census")
SAMPLE_SECONDS = 0.5
PEER_SCRIPTS = ("train.py", "monitor.py", "aux_peer.py", "volunteer.py", "local_swarm.py")
TICKS = os.sysconf("SC_CLK_TCK")


def read_process(pid: int):
    """(parent pid, CPU seconds, command line) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    return int(stat[1]), (int(stat[11]) + int(stat[12])) / TICKS, command


def sample(marker: str, seen: dict) -> None:
    """Record every process under the run: ``seen[pid] = [parent, peak CPU seconds, command]``."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = read_process(int(entry))
            if found is not None:
                processes[int(entry)] = found
    for pid, (parent, cpu, command) in processes.items():
        ours = pid in seen or marker in command or (parent in seen and "p2pd" in command)
        if ours:
            # the first parent (an orphan is handed to init) and the newest command line (one read while the
            # process was still exec'ing shows its launcher's), but not a zombie's, which is empty
            previous = seen.get(pid, [parent, 0.0, command])
            seen[pid] = [previous[0], max(previous[1], cpu), command or previous[2]]


def kind_of(pid: int, seen: dict) -> str:
    parent, _, command = seen[pid]
    if "p2pd" in command:
        return "p2pd"
    if parent in seen and seen[parent][2] == command:
        return "forked child of a peer (DHT, averagers)"
    script = next((name for name in PEER_SCRIPTS if f"scripts/{name}" in command), None)
    return f"peer: {script}" if script else "other (pytest, tools)"


def peer_split(seen: dict) -> list:
    """Each peer's main process, its forked children in start order (the DHT process first, then averagers) and
    the p2pd under them."""
    peers = []
    for pid in sorted(seen):
        if not kind_of(pid, seen).startswith("peer:"):
            continue
        children = sorted(child for child, (parent, _, _) in seen.items() if parent == pid and child != pid)
        forked = [child for child in children if kind_of(child, seen).startswith("forked")]
        daemons = [
            grandchild
            for child in children
            for grandchild, (parent, _, _) in seen.items()
            if parent == child and "p2pd" in seen[grandchild][2]
        ]
        peers.append(
            {
                "script": kind_of(pid, seen)[len("peer: ") :],
                "main": round(seen[pid][1], 2),
                "dht_process": round(seen[forked[0]][1], 2) if forked else None,
                "averager_processes": [round(seen[child][1], 2) for child in forked[1:]],
                "p2pd": round(sum(seen[daemon][1] for daemon in daemons), 2),
            }
        )
    return peers


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--out", required=True, help="JSON artefact to write")
    parser.add_argument("--timeout", type=float, default=1200.0, help="stop the pytest run after this many seconds")
    args = parser.parse_args()
    setup_logging("census")
    stop = StopFlag().install()
    workdir = Path(tempfile.mkdtemp(prefix="cpu_census_"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", f"--basetemp={workdir}"]
    started, load_before = datetime.now(timezone.utc), os.getloadavg()
    process = subprocess.Popen([*command, *args.tests], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict = {}
    deadline = time.monotonic() + args.timeout
    logger.info(f"running {' '.join(args.tests)} (basetemp {workdir})")
    while process.poll() is None and time.monotonic() < deadline and not stop.is_set():
        sample(str(workdir), seen)
        time.sleep(SAMPLE_SECONDS)
    if process.poll() is None:
        process.terminate()
    output = process.communicate(timeout=120)[0].decode(errors="replace")
    shutil.rmtree(workdir, ignore_errors=True)
    wall = (datetime.now(timezone.utc) - started).total_seconds()
    totals: dict = {}
    for pid in seen:
        totals[kind_of(pid, seen)] = round(totals.get(kind_of(pid, seen), 0.0) + seen[pid][1], 2)
    result = {
        "tests": args.tests,
        "outcome": output.strip().splitlines()[-1] if output.strip() else "",
        "exit_code": process.returncode,
        "wall_seconds": round(wall, 1),
        "cpu_seconds_by_kind": totals,
        "cpu_seconds_total": round(sum(totals.values()), 2),
        "processes_seen": len(seen),
        "peers": peer_split(seen),
        "command": " ".join(["python", "scripts/experiments/cpu_census.py", *sys.argv[1:]]),
        "machine": machine_description(),
        "commit": git_commit(),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    logger.info(f"{result['outcome']}; CPU by kind: {totals}; wrote {args.out}")


if __name__ == "__main__":
    main()
