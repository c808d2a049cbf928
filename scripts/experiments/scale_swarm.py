"""Forty volunteers, not three: real swarms of many tiny-ALBERT trainers, each on its own emulated home host.

Two benchmarks, each a subcommand; every trainer is its own network-namespace host (common/tools/netns.py) with
the paper's mix of uploads (cycling 200/100/100/50 Mbit/s, as configs/network/paper_mix.yaml) and a one-way delay
through the user-space delay line; a monitor (500 Mbit/s) records the global steps.

``scale``: for each N in --peers, a monitor and N trainers. Once every trainer has contributed, the swarm trains
--measure-seconds more; per N it records time per global step split into accumulation, averaging and applying,
the matchmaking lead (overlapped with accumulation), peers per averaging group, each peer's share of the global
steps it took part in, start-up to first contributed sample, link bytes per peer per global step (DHT and
averaging together: the namespace's veth counters), RSS and PSS per peer (summed over its process group), and
compute utilisation (the trainers' summary.json). Writes scale.json, scale.csv, scale_table.md and scale.png
to --results.

``storm``: a monitor and --donors trainers train; after --before-seconds, --newcomers trainers start within
--storm-seconds. Records the donors' step rate before, during and after the storm, each newcomer's time to a
loaded state and to its first contributed sample, the donors that did not answer a request in time, and any
download attempt that failed or ran past collaboration.load_state_deadline. Writes storm.json to --results.

    python scripts/experiments/scale_swarm.py scale --peers 4 8 16 32
    python scripts/experiments/scale_swarm.py storm --donors 6 --newcomers 10
    python scripts/experiments/scale_swarm.py storm --donor-upload-mbit 2 collaboration.max_concurrent_state_uploads=1
    python scripts/experiments/scale_swarm.py report --run-dir outputs/scale/scale   # re-read the run folders

Trailing ``key=value`` arguments are config overrides for every peer (``collaboration.target_group_size``,
``collaboration.max_concurrent_state_uploads``, timeouts, ...); each result records the collaboration settings its
peers ran with.

A trainer starts only while the machine keeps --min-available-gib after it (--gib-per-peer each); an N that does not
fit is recorded as stopped early, with the reason, and larger N are not tried.

Needs root for the namespaces; ``--loopback`` runs the same swarms on loopback without link emulation (CI).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

from common.config import CONFIG_KEYS_HELP, CollaborationConfig, load_config
from common.errors import UserError, exit_on_user_error
from common.hivemind_patches.uploads import TURNED_AWAY
from common.lifecycle import StopFlag, setup_logging
from common.metrics import HistoryWriter
from common.startup import STARTUP_FILE
from common.swarm import LocalSwarm, trainer_stop_seconds
from common.tools.netns import EmulatedNetwork, HostSpec
from common.tools.provenance import git_commit, load_average, machine_description

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger("scale")

UPLOAD_CYCLE_MBIT = (200.0, 100.0, 100.0, 50.0)  # the paper's 4 x 200 : 8 x 100 : 4 x 50 cloud mix, in order
MONITOR_MBIT = 500.0
# small enough that 32 trainers, each with its DHT and averager processes and a p2pd, fit a 24 GB machine shared
# with other jobs, and that 2 cores finish a global step in seconds whatever N is
BASE_OVERRIDES = (
    "monitor.wandb_mode=disabled",
    "monitor.checkpoint_every_steps=0",
    "monitor.refresh_seconds=1",
    "training.max_global_steps=1000000",
    "task.total_steps=1000000",
    "task.max_documents=2000",
    "training.num_threads=1",
    "training.log_every_seconds=30",
    "collaboration.expected_peers=1",
    "collaboration.final_averaging_seconds=0",
)
HIVEMIND_TIME = re.compile(r"^(\w{3} \d{2} \d{2}:\d{2}:\d{2}\.\d{3}) \[INFO\] (.*)$")
PEER_ID_LINE = re.compile(r"peer id (Qm\w+)")
# what a newcomer logs about the state download (hivemind's own success line is below the level peers log at)
LOADED_STATE = "loaded the swarm's state"
DONOR_REFUSED = re.compile(r"could not download state from peer (\w+) \(([^)]*)\)")
FAILED_ATTEMPT = re.compile(r"state download attempt \d+ failed")
# glibc keeps fewer per-thread heaps and Go's collector runs at half the heap growth: less resident memory per
# peer (each runs a dozen threads, and its p2pd is a Go program) for a little CPU
LEAN_ENVIRONMENT = {"MALLOC_ARENA_MAX": "2", "GOGC": "50"}
# the settings a result depends on beyond the command's flags, written into it as the peers ran them
RECORDED_COLLABORATION_KEYS = (
    "matchmaking_time",
    "averaging_timeout",
    "next_chunk_timeout",
    "load_state_timeout",
    "load_state_deadline",
    "target_group_size",
    "max_concurrent_state_uploads",
)


# --- what a run measures ---------------------------------------------------------------------------------------
def hivemind_events(log_path: Path) -> List[tuple]:
    """(unix time, message) of hivemind's INFO lines in a peer log (its timestamps carry no year: this one's)."""
    if not log_path.exists():
        return []
    year = datetime.now(timezone.utc).year
    events = []
    for line in log_path.read_text(errors="replace").splitlines():
        match = HIVEMIND_TIME.match(line)
        if match:
            stamp = datetime.strptime(f"{year} {match.group(1)}", "%Y %b %d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            events.append((stamp.timestamp(), match.group(2)))
    return events


def optimizer_rounds(log_path: Path) -> List[dict]:
    """One record per optimizer step a trainer logged whole: transition into epoch k, the gradient round's
    pre-scheduling, "Beginning optimizer step #k", the gradient round's end and the transition to epoch k + 1."""
    rounds, current, entered, pre = [], None, {}, None
    for when, message in hivemind_events(log_path):
        if message.startswith("Transitioning to epoch"):
            epoch = int(message.split()[-1])
            if current is not None and current.get("averaged") is not None:
                current["transition"] = when
                rounds.append(current)
            current = None
            entered[epoch] = when
        elif message.startswith("Pre-scheduling gradient averaging round"):
            pre = when
        elif message.startswith("Beginning optimizer step #"):
            step = int(message.rsplit("#", 1)[1])
            current = {"step": step, "entered": entered.get(step), "pre": pre, "begin": when}
            current["averaged"], current["group"] = None, None
        elif current is not None and message.startswith("Averaged gradients with"):
            current["averaged"], current["group"] = when, int(message.split()[3])
        elif current is not None and message.startswith(("Averaging gradients failed", "Skipped averaging")):
            current["averaged"], current["group"] = when, 1
    return rounds


def veth_bytes(namespace: str) -> Dict[str, int]:
    """Bytes through a host's link so far, both directions: everything the host sent and received (DHT, both
    averagers, state downloads), as its veth counts them."""
    result = subprocess.run(
        ["ip", "-n", namespace, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True
    )
    if result.returncode != 0:
        return {"rx": 0, "tx": 0}
    stats = json.loads(result.stdout)[0]["stats64"]
    return {"rx": stats["rx"]["bytes"], "tx": stats["tx"]["bytes"]}


def group_memory_mib(pgid: int) -> Dict[str, float]:
    """RSS and PSS summed over a peer's process group (its DHT and averager processes and p2pd). RSS counts the
    pages forked processes share once per process; PSS splits each shared page among its sharers, so PSS adds up
    to what the peers cost the machine (file-backed pages, torch's libraries, are split among every process that
    maps them, other jobs' included); USS counts only the pages no other process shares, a peer's floor."""
    rss = pss = uss = 0
    processes = 0
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) != pgid:
                continue
            info = process.memory_full_info()
            rss, pss, uss, processes = rss + info.rss, pss + info.pss, uss + info.uss, processes + 1
        except (psutil.Error, ProcessLookupError, OSError):
            continue
    return {"rss_mib": rss / 2**20, "pss_mib": pss / 2**20, "uss_mib": uss / 2**20, "processes": processes}


def delay_lines_pss_mib() -> float:
    """The emulated network's own cost: the delay-line processes (one per host with a delay) this driver started."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if "common.tools.linkdelay" in " ".join(child.cmdline()):
                total += child.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def first_contribution_at(peer_dir: Path) -> Optional[float]:
    startup = read_json(peer_dir / STARTUP_FILE)
    return startup["ended_at"].get("first micro-batch") if startup else None


def median(values: Sequence[float]) -> Optional[float]:
    values = [value for value in values if value is not None]
    return round(statistics.median(values), 3) if values else None


def processes_left(run_dir: Path) -> List[str]:
    """Processes (peers, their DHT and averager processes, p2pd) that still name the run's folder; this driver
    names it too and is no peer."""
    listing = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listing if "scale_swarm.py" not in line]


def provenance(argv: Sequence[str]) -> dict:
    return {
        "command": " ".join(["python", "scripts/experiments/scale_swarm.py", *argv]),
        "machine": machine_description(),
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_average(),
    }


# --- one swarm on emulated hosts ---------------------------------------------------------------------------------
def trainer_hosts(names: Sequence[str], delay_ms: float, offset: int = 0) -> List[HostSpec]:
    return [
        HostSpec(
            name,
            "trainer",
            UPLOAD_CYCLE_MBIT[(offset + index) % len(UPLOAD_CYCLE_MBIT)],
            UPLOAD_CYCLE_MBIT[(offset + index) % len(UPLOAD_CYCLE_MBIT)],
            delay_ms=delay_ms,
        )
        for index, name in enumerate(names)
    ]


def peer_collaboration(args, overrides: Sequence[str]) -> CollaborationConfig:
    """The collaboration section every peer runs with (validated here, before any peer starts: a bad override is
    one line and exit code 2); its averaging and state-download settings go into the results."""
    return load_config(args.config, [*BASE_OVERRIDES, *overrides]).collaboration


def collaboration_record(collab: CollaborationConfig) -> dict:
    return {key: getattr(collab, key) for key in RECORDED_COLLABORATION_KEYS}


@contextlib.contextmanager
def emulated_swarm(args, run_dir: Path, hosts: List[HostSpec], overrides: Sequence[str]):
    """A LocalSwarm whose peers run on the hosts (or on loopback with --loopback); everything stops on exit."""
    with contextlib.ExitStack() as stack:
        network = None
        if not args.loopback:
            network = stack.enter_context(EmulatedNetwork(hosts))
        swarm = stack.enter_context(
            LocalSwarm(
                args.config,
                run_dir,
                [*BASE_OVERRIDES, *overrides],
                command_prefix=network.command_prefix_for if network is not None else None,
                host_overrides=network.peer_overrides if network is not None else None,
                environment=dict(LEAN_ENVIRONMENT) if args.lean else {},
            )
        )
        yield swarm, network


def donors_not_ready(joined: int, donors: int, tripped: Optional[str]) -> str:
    """Why the swarm a join storm needs was not ready: the memory guard, donors that never contributed, or a
    monitor that has not recorded a step yet (it records one once it has seen two later ones)."""
    if tripped:
        return f"stopped before the storm: {tripped}"
    if joined < donors:
        return f"only {joined} of {donors} donors contributed within --join-timeout"
    return "every donor contributed, but the monitor recorded no global step within --join-timeout: raise it"


class MemoryGuard:
    """Stops a run before it starves the machine: the swarm's PSS over --memory-limit-gib, or the machine's
    available memory under --min-available-gib."""

    def __init__(self, args):
        self.limit_mib, self.floor_mib = args.memory_limit_gib * 1024, args.min_available_gib * 1024
        self.per_peer_mib = args.gib_per_peer * 1024
        self.peak_swarm_pss_mib, self.min_available_mib, self.tripped = 0.0, float("inf"), None

    def check(self, swarm: LocalSwarm, with_pss: bool) -> Optional[str]:
        available = psutil.virtual_memory().available / 2**20
        self.min_available_mib = min(self.min_available_mib, available)
        if with_pss:
            pss = sum(group_memory_mib(peer.process.pid)["pss_mib"] for peer in swarm.peers.values() if peer.alive())
            self.peak_swarm_pss_mib = max(self.peak_swarm_pss_mib, pss)
            if pss > self.limit_mib:
                self.tripped = f"the swarm's PSS reached {pss / 1024:.1f} GiB (limit {self.limit_mib / 1024:.0f})"
        if available < self.floor_mib:
            self.tripped = f"the machine had only {available / 1024:.1f} GiB available"
        return self.tripped

    def room_for_one_more(self, swarm: LocalSwarm, run_dir: Path, stop: StopFlag) -> bool:
        """Start another peer only if the machine keeps --min-available-gib after it and the peers still starting
        have grown to their working size (--gib-per-peer each, what one costs the machine once it trains); wait
        for those to contribute first, and give up (recording why) when even that leaves no room."""
        while not stop.is_set():
            starting = [
                name
                for name, peer in swarm.peers.items()
                if peer.role == "trainer" and peer.alive() and first_contribution_at(run_dir / name) is None
            ]
            available = psutil.virtual_memory().available / 2**20
            self.min_available_mib = min(self.min_available_mib, available)
            needed = self.floor_mib + self.per_peer_mib * (len(starting) + 1)
            if available >= needed:
                return True
            if not starting:
                trainers = sum(peer.role == "trainer" for peer in swarm.peers.values())
                self.tripped = (
                    f"no room for trainer {trainers + 1}: {available / 1024:.1f} GiB available, a peer needs "
                    f"{self.per_peer_mib / 1024:.2f} GiB and {self.floor_mib / 1024:.0f} GiB stay free"
                )
                logger.warning(self.tripped)
                return False
            logger.info(f"waiting for {len(starting)} starting trainers before the next ({available / 1024:.1f} GiB)")
            stop.wait(5)
        return False


# --- scale ---------------------------------------------------------------------------------------------------------
def run_scale(args, count: int, stop: StopFlag) -> dict:
    run_dir = args.run_dir / f"n{count:02d}"
    names = [f"t{index:02d}" for index in range(count)]
    hosts = [HostSpec("monitor", "monitor", MONITOR_MBIT, MONITOR_MBIT), *trainer_hosts(names, args.delay_ms)]
    overrides = [f"collaboration.target_batch_size={args.target_batch_size}", *args.overrides]
    collab = peer_collaboration(args, overrides)
    result: dict = {
        "peers": count,
        "load_average_at_start": load_average(),
        "links": "loopback" if args.loopback else f"cycling {UPLOAD_CYCLE_MBIT} Mbit/s, +{args.delay_ms:g} ms one way",
        "target_batch_size": args.target_batch_size,
        "lean_environment": args.lean,
        "target_group_size": collab.target_group_size,
        "collaboration": collaboration_record(collab),
        "overrides": list(args.overrides),
    }
    guard = MemoryGuard(args)
    available_before = psutil.virtual_memory().available / 2**20
    started = time.time()
    with emulated_swarm(args, run_dir, hosts, overrides) as (swarm, network):
        swarm.start_first_peer("monitor", "monitor", timeout=args.join_timeout)
        for name in names:
            if not guard.room_for_one_more(swarm, run_dir, stop) or stop.is_set():
                break
            swarm.start("trainer", name)
            stop.wait(args.start_spacing)
        result["trainers_started"] = sum(name in swarm.peers for name in names)
        # every trainer contributed: the measured window starts
        deadline = time.monotonic() + args.join_timeout
        while not stop.is_set() and time.monotonic() < deadline:
            joined = [name for name in names if first_contribution_at(run_dir / name) is not None]
            if len(joined) == count or guard.check(swarm, with_pss=False) or guard.tripped:
                break
            logger.info(f"N={count}: {len(joined)}/{count} trainers contributed ({time.time() - started:.0f} s)")
            stop.wait(10)
        joined = [name for name in names if first_contribution_at(run_dir / name) is not None]
        result["trainers_contributed_before_window"] = len(joined)
        # the window opens with the first global step after the last join, so that it holds whole steps only
        last_join = max((first_contribution_at(run_dir / name) for name in joined), default=time.time())
        while not stop.is_set() and time.monotonic() < deadline + args.measure_seconds:
            if any(entry["time"] >= last_join for entry in HistoryWriter(run_dir / "monitor").read()):
                break
            stop.wait(1)
        window_start = time.time()
        bytes_start = (
            {name: veth_bytes(network.namespaces[network.index_of(name)]) for name in names} if network else {}
        )
        memory, window_end = {}, window_start + args.measure_seconds
        while not stop.is_set() and time.time() < window_end and guard.tripped is None:
            sample = len(memory) == 0 and time.time() > window_start + args.measure_seconds / 2
            if sample:  # one full reading in mid-window, when every peer holds its steady-state memory
                memory = {name: group_memory_mib(swarm.peers[name].process.pid) for name in names}
                memory["monitor"] = group_memory_mib(swarm.peers["monitor"].process.pid)
                result["delay_lines_pss_mib"] = round(delay_lines_pss_mib(), 1)
            guard.check(swarm, with_pss=sample)
            history = HistoryWriter(run_dir / "monitor").read()
            logger.info(
                f"N={count}: window {time.time() - window_start:.0f}/{args.measure_seconds:.0f} s, "
                f"global step {history[-1]['step'] if history else -1}, load {load_average()}, "
                f"available {psutil.virtual_memory().available / 2**30:.1f} GiB"
            )
            stop.wait(10)
        window_end = time.time()
        bytes_end = {name: veth_bytes(network.namespaces[network.index_of(name)]) for name in names} if network else {}
        result["load_average_at_end"] = load_average()
        grace = trainer_stop_seconds(collab.averaging_timeout)
        swarm.stop_many([name for name in names if name in swarm.peers], grace_seconds=grace)
        time.sleep(3)
        swarm.stop_many(["monitor"])
        result["exit_codes"] = {name: peer.process.returncode for name, peer in swarm.peers.items()}
    result["aborted"] = guard.tripped
    result["memory_guard"] = {
        "machine_available_before_gib": round(available_before / 1024, 2),
        "machine_available_min_gib": round(guard.min_available_mib / 1024, 2),
        "swarm_pss_peak_gib": round(guard.peak_swarm_pss_mib / 1024, 2),
    }
    result.update(summarize_scale(run_dir, names, window_start, window_end, bytes_start, bytes_end, memory))
    result.update(window_start=window_start, window_end=window_end, samples_per_step_mean=samples_per_step(run_dir))
    result["wall_seconds"] = round(time.time() - started)
    return result


def summarize_scale(run_dir, names, window_start, window_end, bytes_start, bytes_end, memory) -> dict:
    history = [
        entry for entry in HistoryWriter(run_dir / "monitor").read() if window_start <= entry["time"] <= window_end
    ]
    steps = len(history)
    step_times = [b["time"] - a["time"] for a, b in zip(history, history[1:])]
    ids = {peer_id: name for entry in history for peer_id, name in entry.get("names", {}).items()}
    took_part = {name: 0 for name in names}
    for entry in history:
        for peer_id in entry["contributions"]:
            if ids.get(peer_id) in took_part:
                took_part[ids[peer_id]] += 1
    share = {name: round(took_part[name] / steps, 3) if steps else None for name in names}
    rounds = [
        item
        for name in names
        for item in optimizer_rounds(run_dir / name / "peer.log")
        if window_start <= item["begin"] <= window_end
    ]
    startup = {name: read_json(run_dir / name / STARTUP_FILE) for name in names}
    summaries = {name: read_json(run_dir / name / "summary.json") for name in names}
    traffic = {}
    for name in bytes_start if steps else ():
        sent = bytes_end[name]["tx"] - bytes_start[name]["tx"]
        received = bytes_end[name]["rx"] - bytes_start[name]["rx"]
        traffic[name] = {"sent_mib_per_step": sent / 2**20 / steps, "received_mib_per_step": received / 2**20 / steps}
    trainer_memory = [memory[name] for name in names if name in memory]
    used = [s["samples_used"] for s in summaries.values() if s]
    computed = [s["samples"] for s in summaries.values() if s]
    return {
        "window_seconds": round(window_end - window_start, 1),
        "global_steps_in_window": steps,
        "global_step_seconds_median": median(step_times),
        "accumulation_seconds_median": median([r["begin"] - r["entered"] for r in rounds if r["entered"]]),
        "matchmaking_lead_seconds_median": median([r["begin"] - r["pre"] for r in rounds if r["pre"]]),
        "averaging_seconds_median": median([r["averaged"] - r["begin"] for r in rounds]),
        "apply_seconds_median": median([r["transition"] - r["averaged"] for r in rounds]),
        "group_size_mean": round(statistics.mean([r["group"] for r in rounds]), 2) if rounds else None,
        "group_size_min": min((r["group"] for r in rounds), default=None),
        "rounds_not_averaged": sum(r["group"] == 1 for r in rounds),
        "rounds_logged": len(rounds),
        "trainers_per_step_mean": round(statistics.mean([e["peers"] for e in history]), 2) if history else None,
        "step_share_mean": round(statistics.mean([v for v in share.values() if v is not None]), 3) if steps else None,
        "step_share_min": min((v for v in share.values() if v is not None), default=None),
        "step_share": share,
        "first_contribution_seconds_median": median([s["total"] for s in startup.values() if s]),
        "first_contribution_seconds_max": round(max((s["total"] for s in startup.values() if s), default=0), 1),
        "state_download_seconds_median": median([s["phases"].get("state download") for s in startup.values() if s]),
        "sent_mib_per_peer_per_step_median": median([t["sent_mib_per_step"] for t in traffic.values()]),
        "received_mib_per_peer_per_step_median": median([t["received_mib_per_step"] for t in traffic.values()]),
        "traffic": {name: {k: round(v, 3) for k, v in t.items()} for name, t in traffic.items()},
        "rss_mib_per_trainer_median": median([m["rss_mib"] for m in trainer_memory]),
        "pss_mib_per_trainer_median": median([m["pss_mib"] for m in trainer_memory]),
        "uss_mib_per_trainer_median": median([m["uss_mib"] for m in trainer_memory]),
        "pss_mib_monitor": round(memory["monitor"]["pss_mib"], 1) if "monitor" in memory else None,
        "pss_gib_swarm": round(sum(m["pss_mib"] for m in memory.values()) / 1024, 2) if memory else None,
        "processes_per_trainer": median([m["processes"] for m in trainer_memory]),
        "used_share_median": median([s["used_share"] for s in summaries.values() if s]),
        "compute_share_median": median([s["compute_share"] for s in summaries.values() if s]),
        "swarm_used_share": round(sum(used) / sum(computed), 4) if computed and sum(computed) else None,
        "history_used_share_last": history[-1].get("used_share") if history else None,
        "history_compute_share_last": history[-1].get("compute_share") if history else None,
        "trainer_summaries_found": sum(s is not None for s in summaries.values()),
    }


SCALE_COLUMNS = (
    "peers",
    "global_steps_in_window",
    "global_step_seconds_median",
    "accumulation_seconds_median",
    "matchmaking_lead_seconds_median",
    "averaging_seconds_median",
    "apply_seconds_median",
    "samples_per_step_mean",
    "group_size_mean",
    "trainers_per_step_mean",
    "step_share_mean",
    "step_share_min",
    "first_contribution_seconds_median",
    "first_contribution_seconds_max",
    "sent_mib_per_peer_per_step_median",
    "received_mib_per_peer_per_step_median",
    "rss_mib_per_trainer_median",
    "pss_mib_per_trainer_median",
    "uss_mib_per_trainer_median",
    "pss_gib_swarm",
    "delay_lines_pss_mib",
    "used_share_median",
    "compute_share_median",
    "swarm_used_share",
    "load_average_at_start",
    "aborted",
)


def plot_scale(rows: List[dict], results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in rows if row.get("global_steps_in_window")]
    if not rows:
        return
    peers = [row["peers"] for row in rows]
    panels = [
        (
            "time per global step (s)",
            [
                "global_step_seconds_median",
                "accumulation_seconds_median",
                "averaging_seconds_median",
                "apply_seconds_median",
            ],
        ),
        ("peers", ["group_size_mean", "trainers_per_step_mean"]),
        ("share", ["step_share_mean", "step_share_min", "used_share_median", "compute_share_median"]),
        ("seconds from start", ["first_contribution_seconds_median", "first_contribution_seconds_max"]),
        (
            "MiB per peer per global step",
            ["sent_mib_per_peer_per_step_median", "received_mib_per_peer_per_step_median"],
        ),
        (
            "MiB per trainer",
            ["rss_mib_per_trainer_median", "pss_mib_per_trainer_median", "uss_mib_per_trainer_median"],
        ),
    ]
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for axis, (label, keys) in zip(axes.flat, panels):
        for key in keys:
            axis.plot(peers, [row.get(key) for row in rows], marker="o", label=key.replace("_median", ""))
        axis.set_xscale("log", base=2)
        axis.set_xticks(peers, [str(p) for p in peers])
        axis.set_xlabel("concurrent trainers (N)")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.suptitle("tiny ALBERT swarm on emulated home links (200/100/100/50 Mbit/s), 2-core machine")
    figure.tight_layout()
    figure.savefig(results / "scale.png", dpi=110)
    plt.close(figure)


def scale_main(args, stop: StopFlag) -> None:
    results_path = args.results / "scale.json"
    previous = read_json(results_path) or {}
    runs = list(previous.get("runs", [])) if args.append else []
    for count in args.peers:
        if stop.is_set():
            break
        logger.info(f"N={count}: starting a monitor and {count} trainers")
        row = run_scale(args, count, stop)
        row["provenance"] = provenance(sys.argv[1:])
        runs.append(row)
        logger.info("N=%d: %s", count, json.dumps({key: row.get(key) for key in SCALE_COLUMNS}))
        write_scale(args.results, runs)
        if row["aborted"]:
            logger.warning(f"N={count} stopped early: {row['aborted']}; not trying larger N")
            break
    leftovers = processes_left(args.run_dir)
    if leftovers:
        logger.error("processes left behind:\n" + "\n".join(leftovers))


def samples_per_step(run_dir: Path) -> Optional[float]:
    """Mean samples in the global steps after the last trainer joined: hivemind's peers stop accumulating only when
    they see the swarm's progress reach the target, so a global step can hold more than the target."""
    joins = [first_contribution_at(folder) for folder in run_dir.glob("t*")]
    last_join = max((join for join in joins if join is not None), default=0.0)
    steps = [entry["samples"] for entry in HistoryWriter(run_dir / "monitor").read() if entry["time"] >= last_join]
    return round(statistics.mean(steps), 1) if steps else None


def report_main(args) -> None:
    """Add what later versions of this driver record to scale.json's runs, from their run folders, and redraw."""
    runs = read_json(args.results / "scale.json")["runs"]
    for run in runs:
        folder = args.run_dir / f"n{run['peers']:02d}"
        if folder.exists():
            run["samples_per_step_mean"] = samples_per_step(folder)
    write_scale(args.results, runs)
    logger.info(f"rewrote {args.results / 'scale.json'} and its table and plot")


def write_scale(results: Path, runs: List[dict]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "scale.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    with (results / "scale.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=SCALE_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    (results / "scale_table.md").write_text(markdown_table(runs))
    plot_scale(runs, results)


TABLE = (
    ("N", "peers", "{}"),
    ("steps in window", "global_steps_in_window", "{}"),
    ("s / global step", "global_step_seconds_median", "{:.1f}"),
    ("accumulation s", "accumulation_seconds_median", "{:.1f}"),
    ("matchmaking lead s", "matchmaking_lead_seconds_median", "{:.1f}"),
    ("averaging s", "averaging_seconds_median", "{:.2f}"),
    ("apply s", "apply_seconds_median", "{:.2f}"),
    ("samples / step (target)", ("samples_per_step_mean", "target_batch_size"), "{:.0f} ({})"),
    ("group size", "group_size_mean", "{:.1f}"),
    ("trainers / step", "trainers_per_step_mean", "{:.1f}"),
    ("step share mean (min)", ("step_share_mean", "step_share_min"), "{:.2f} ({:.2f})"),
    ("start to 1st sample s, median (max)", ("first_contribution_seconds_median", "first_contribution_seconds_max"),
     "{:.0f} ({:.0f})"),
    ("MiB sent / received per peer per step", ("sent_mib_per_peer_per_step_median",
                                                "received_mib_per_peer_per_step_median"), "{:.1f} / {:.1f}"),
    ("MiB per trainer RSS / PSS / USS", ("rss_mib_per_trainer_median", "pss_mib_per_trainer_median",
                                          "uss_mib_per_trainer_median"), "{:.0f} / {:.0f} / {:.0f}"),
    ("swarm PSS GiB", "pss_gib_swarm", "{:.1f}"),
    ("used share (swarm)", "swarm_used_share", "{:.3f}"),
    ("compute share (median)", "compute_share_median", "{:.2f}"),
    ("load at start", "load_average_at_start", "{}"),
    ("stopped early", "aborted", "{}"),
)  # fmt: skip


def markdown_table(runs: List[dict]) -> str:
    """One row per run, in the order run, every run included."""

    def cell(run: dict, keys, form: str) -> str:
        keys = keys if isinstance(keys, tuple) else (keys,)
        values = [run.get(key) for key in keys]
        if any(value is None for value in values):
            return "-" if keys != ("aborted",) else "no"
        return form.format(*values)

    lines = ["| " + " | ".join(head for head, _, _ in TABLE) + " |", "|" + "---|" * len(TABLE)]
    lines += ["| " + " | ".join(cell(run, keys, form) for _, keys, form in TABLE) + " |" for run in runs]
    return "\n".join(lines) + "\n"


# --- storm ---------------------------------------------------------------------------------------------------------
def peer_ids(run_dir: Path, names: Sequence[str]) -> Dict[str, str]:
    ids = {}
    for name in names:
        log = run_dir / name / "peer.log"
        match = PEER_ID_LINE.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            ids[match.group(1)] = name
    return ids


def newcomers_in_a_step(run_dir: Path, newcomers: Sequence[str]) -> bool:
    """Every newcomer that contributed a sample is named in some global step of the monitor's history."""
    contributed = [name for name in newcomers if first_contribution_at(run_dir / name) is not None]
    ids = peer_ids(run_dir, contributed)
    seen = {ids.get(peer) for entry in HistoryWriter(run_dir / "monitor").read() for peer in entry["contributions"]}
    return all(name in seen for name in contributed)


def step_rate(history: List[dict], start: float, end: float) -> Optional[float]:
    """Global steps per minute the monitor recorded in [start, end)."""
    if end - start < 1:
        return None
    return round(sum(start <= entry["time"] < end for entry in history) * 60 / (end - start), 2)


def donor_step_rates(run_dir: Path, donors: Sequence[str], start: float, end: float) -> Dict[str, Optional[float]]:
    """Each donor's own optimizer steps per minute in [start, end): what it finished while it served states."""
    rates = {}
    for name in donors:
        path = run_dir / name / "steps.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        rates[name] = (
            round(sum(start <= r["time"] < end for r in records) * 60 / (end - start), 2) if end > start else None
        )
    return rates


def storm_main(args, stop: StopFlag) -> None:
    run_dir = args.run_dir
    donors = [f"d{index:02d}" for index in range(args.donors)]
    newcomers = [f"n{index:02d}" for index in range(args.newcomers)]
    hosts = [
        HostSpec("monitor", "monitor", MONITOR_MBIT, MONITOR_MBIT),
        *trainer_hosts(donors, args.delay_ms),
        *trainer_hosts(newcomers, args.delay_ms, offset=args.donors),
    ]
    if args.donor_upload_mbit:  # donors on slow uplinks: every state they serve queues behind the others
        for host in hosts[1 : 1 + len(donors)]:
            host.upload_mbit = args.donor_upload_mbit
    overrides = [
        f"collaboration.target_batch_size={args.target_batch_size}",
        f"collaboration.load_state_deadline={args.load_state_deadline:g}",
        *args.overrides,
    ]
    collab = peer_collaboration(args, overrides)
    rng = random.Random(args.seed)
    result: dict = provenance(sys.argv[1:])
    guard = MemoryGuard(args)
    started = time.time()
    with emulated_swarm(args, run_dir, hosts, overrides) as (swarm, network):
        swarm.start_first_peer("monitor", "monitor", timeout=args.join_timeout)
        for name in donors:
            swarm.start("trainer", name)
        deadline = time.monotonic() + args.join_timeout
        while not stop.is_set():
            joined = [name for name in donors if first_contribution_at(run_dir / name) is not None]
            # the baseline starts once the swarm steps (the first global step comes a step's worth later)
            if len(joined) == len(donors) and HistoryWriter(run_dir / "monitor").read():
                break
            tripped = guard.check(swarm, with_pss=False)
            if tripped or time.monotonic() > deadline:
                raise UserError(donors_not_ready(len(joined), len(donors), tripped))
            logger.info(f"donors: {len(joined)}/{len(donors)} contributed")
            stop.wait(2)
        serving = ["monitor", *donors]

        def sent_bytes() -> Dict[str, int]:
            return {n: veth_bytes(network.namespaces[network.index_of(n)])["tx"] for n in serving} if network else {}

        before_start, sent_at_before = time.time(), sent_bytes()
        while not stop.is_set() and time.time() < before_start + args.before_seconds:
            history = HistoryWriter(run_dir / "monitor").read()
            logger.info(f"before the storm: global step {history[-1]['step'] if history else -1}")
            stop.wait(10)
        storm_start, sent_at_storm = time.time(), sent_bytes()
        offsets = sorted(rng.uniform(0, args.storm_seconds) for _ in newcomers)
        for name, offset in zip(newcomers, offsets):
            if stop.wait(max(0.0, storm_start + offset - time.time())):
                break  # stopped: no more newcomers, the rest of the run is recorded as far as it got
            swarm.start("trainer", name)
        result["newcomers_started_within_seconds"] = round(time.time() - storm_start, 2)
        logger.info(f"storm: {len(newcomers)} newcomers started within {result['newcomers_started_within_seconds']} s")
        deadline = storm_start + args.load_state_deadline + args.join_timeout
        while not stop.is_set() and time.time() < deadline:
            waiting = [
                name
                for name in newcomers
                if first_contribution_at(run_dir / name) is None and swarm.peers[name].alive()
            ]
            if not waiting or guard.check(swarm, with_pss=False):
                break
            # a newcomer that gave up (exit 2 at load_state_deadline) is neither waiting nor contributing
            ended = [
                name
                for name in newcomers
                if first_contribution_at(run_dir / name) is None and not swarm.peers[name].alive()
            ]
            history = HistoryWriter(run_dir / "monitor").read()
            logger.info(
                f"storm +{time.time() - storm_start:.0f} s: {len(newcomers) - len(waiting) - len(ended)}/"
                f"{len(newcomers)} newcomers contributed, {len(ended)} ended without, "
                f"global step {history[-1]['step'] if history else -1}, load {load_average()}"
            )
            stop.wait(2)
        storm_end, sent_at_end = time.time(), sent_bytes()
        memory = {name: group_memory_mib(peer.process.pid) for name, peer in swarm.peers.items() if peer.alive()}
        # the after window lasts --after-seconds and until every newcomer that contributed is in a global step
        # (the step its first samples went into), --join-timeout at most
        while not stop.is_set() and time.time() < storm_end + args.after_seconds + args.join_timeout:
            if time.time() >= storm_end + args.after_seconds and newcomers_in_a_step(run_dir, newcomers):
                break
            stop.wait(min(2.0, max(0.1, storm_end + args.after_seconds - time.time())))
        after_end = time.time()
        result["load_average_at_end"] = load_average()
        trainers = [name for name in [*donors, *newcomers] if name in swarm.peers]
        grace = trainer_stop_seconds(collab.averaging_timeout)
        swarm.stop_many(trainers, grace_seconds=grace)
        time.sleep(3)
        swarm.stop_many(["monitor"])
        result["exit_codes"] = {name: peer.process.returncode for name, peer in swarm.peers.items()}
    history = HistoryWriter(run_dir / "monitor").read()
    ids = peer_ids(run_dir, ["monitor", *donors, *newcomers])
    arrivals = []
    for index, name in enumerate(newcomers):
        startup = read_json(run_dir / name / STARTUP_FILE)
        log = (
            (run_dir / name / "peer.log").read_text(errors="replace") if (run_dir / name / "peer.log").exists() else ""
        )
        refusals = [(ids.get(peer, peer), reason) for peer, reason in DONOR_REFUSED.findall(log)]
        record = {
            "name": name,
            "started_after_storm_start_seconds": round(offsets[index], 2),
            "contributed": startup is not None,
            "exit_code": result["exit_codes"].get(name),
            "loaded_state": LOADED_STATE in log,
            "failed_download_attempts": len(FAILED_ATTEMPT.findall(log)),
            "donors_that_did_not_serve": [{"donor": donor, "reason": reason} for donor, reason in refusals],
        }
        if startup is not None:
            process_start = startup["ended_at"]["imports"] - startup["phases"]["imports"]
            record["to_loaded_state_seconds"] = round(startup["ended_at"]["state download"] - process_start, 2)
            record["state_download_phase_seconds"] = startup["phases"]["state download"]
            record["to_first_contribution_seconds"] = round(startup["total"], 2)
        samples_used = [entry for entry in history if any(ids.get(p) == name for p in entry["contributions"])]
        record["global_steps_contributed"] = len(samples_used)
        arrivals.append(record)
    # requests a serving peer turned away at its collaboration.max_concurrent_state_uploads (each asked the next peer)
    turned_away = {}
    for name in ["monitor", *donors, *newcomers]:
        log = run_dir / name / "peer.log"
        count = log.read_text(errors="replace").count(TURNED_AWAY) if log.exists() else 0
        if count:
            turned_away[name] = count
    refused: Dict[str, int] = {}
    for record in arrivals:
        for refusal in record["donors_that_did_not_serve"]:
            refused[refusal["donor"]] = refused.get(refusal["donor"], 0) + 1
    # what each serving peer sent during the storm beyond its pace before it: the states it uploaded (and the
    # newcomers' share of averaging and DHT traffic)
    extra_sent_mib = {}
    for name in sent_at_storm:
        pace = (sent_at_storm[name] - sent_at_before[name]) / max(storm_start - before_start, 1.0)
        extra = sent_at_end[name] - sent_at_storm[name] - pace * (storm_end - storm_start)
        extra_sent_mib[name] = round(extra / 2**20, 1)
    # the span in which some newcomer was downloading (from its first attempt to the last newcomer's loaded state):
    # the donors' serving, apart from the rest of the newcomers' start-up, which competes for the same CPU
    startups = [read_json(run_dir / name / STARTUP_FILE) for name in newcomers]
    download_spans = [(s["ended_at"]["optimizer"], s["ended_at"]["state download"]) for s in startups if s]
    downloads_from = min((a for a, _ in download_spans), default=storm_start)
    downloads_to = max((b for _, b in download_spans), default=storm_start)
    before = donor_step_rates(run_dir, donors, before_start, storm_start)
    downloading = donor_step_rates(run_dir, donors, downloads_from, downloads_to)
    during = donor_step_rates(run_dir, donors, storm_start, storm_end)
    after = donor_step_rates(run_dir, donors, storm_end, after_end)
    result.update(
        {
            "donors": len(donors),
            "newcomers": len(newcomers),
            "delay_ms_one_way": 0 if args.loopback else args.delay_ms,
            "lean_environment": args.lean,
            "links": "loopback"
            if args.loopback
            else {host.name: f"{host.upload_mbit:g} up / {host.download_mbit:g} down Mbit/s" for host in hosts},
            "load_state_deadline": args.load_state_deadline,
            "donor_upload_mbit": args.donor_upload_mbit,
            "max_state_uploads": collab.max_concurrent_state_uploads,
            "collaboration": collaboration_record(collab),
            "aborted": guard.tripped,
            "seconds": {
                "before": round(storm_start - before_start, 1),
                "storm": round(storm_end - storm_start, 1),
                "downloading": round(downloads_to - downloads_from, 1),
                "after": round(after_end - storm_end, 1),
            },
            "global_steps_per_minute": {
                "before": step_rate(history, before_start, storm_start),
                "storm": step_rate(history, storm_start, storm_end),
                "downloading": step_rate(history, downloads_from, downloads_to),
                "after": step_rate(history, storm_end, after_end),
            },
            "donor_steps_per_minute_median": {
                "before": median(list(before.values())),
                "storm": median(list(during.values())),
                "downloading": median(list(downloading.values())),
                "after": median(list(after.values())),
            },
            "donor_steps_per_minute": {"before": before, "storm": during, "downloading": downloading, "after": after},
            "newcomers_contributed": sum(record["contributed"] for record in arrivals),
            "newcomers_loaded_state": sum(record["loaded_state"] for record in arrivals),
            "newcomers_failed_download_attempts": sum(record["failed_download_attempts"] for record in arrivals),
            "donor_requests_not_served": sum(len(record["donors_that_did_not_serve"]) for record in arrivals),
            "requests_not_served_by_donor": refused,
            "requests_turned_away_at_the_limit": turned_away,
            "sent_during_storm_beyond_before_pace_mib": extra_sent_mib,
            "downloads_past_deadline": sum(
                record.get("state_download_phase_seconds", float("inf")) > args.load_state_deadline
                for record in arrivals
            ),
            "to_loaded_state_seconds_median": median([r.get("to_loaded_state_seconds") for r in arrivals]),
            "to_loaded_state_seconds_max": max((r.get("to_loaded_state_seconds", 0) for r in arrivals), default=None),
            "to_first_contribution_seconds_median": median([r.get("to_first_contribution_seconds") for r in arrivals]),
            "to_first_contribution_seconds_max": max(
                (r.get("to_first_contribution_seconds", 0) for r in arrivals), default=None
            ),
            "state_download_phase_seconds_median": median([r.get("state_download_phase_seconds") for r in arrivals]),
            "state_download_phase_seconds_max": max(
                (r.get("state_download_phase_seconds", 0) for r in arrivals), default=None
            ),
            "pss_mib_at_storm_end": {name: round(m["pss_mib"], 1) for name, m in memory.items()},
            "newcomer_details": arrivals,
            "wall_seconds": round(time.time() - started),
        }
    )
    result["processes_left"] = processes_left(run_dir)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / args.storm_file
    out.write_text(json.dumps(result, indent=2) + "\n")
    logger.info(
        f"storm: {result['newcomers_contributed']}/{len(newcomers)} newcomers contributed; loaded state after "
        f"{result['to_loaded_state_seconds_median']} s (median), max {result['to_loaded_state_seconds_max']} s; "
        f"donor steps/min before {result['donor_steps_per_minute_median']['before']}, storm "
        f"{result['donor_steps_per_minute_median']['storm']}; failed attempts "
        f"{result['newcomers_failed_download_attempts']}, donor requests not served {refused}; written to {out}"
    )


# --- command line --------------------------------------------------------------------------------------------------
def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CONFIG_KEYS_HELP
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", default=str(ROOT / "configs/albert/tiny.yaml"), help="the run config of every peer"
    )
    common.add_argument("--run-dir", type=Path, help="where the peers' folders go (default outputs/scale/<mode>)")
    common.add_argument("--results", type=Path, default=ROOT / "paper_results/scale", help="where results go")
    common.add_argument("--target-batch-size", type=int, default=512, help="samples per global step")
    common.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay each host adds to what it sends")
    common.add_argument("--loopback", action="store_true", help="no emulated hosts: every peer on loopback (CI)")
    common.add_argument("--join-timeout", type=float, default=300.0, help="seconds the peers may take to contribute")
    common.add_argument("--memory-limit-gib", type=float, default=18.0, help="stop a run whose PSS passes this")
    common.add_argument("--min-available-gib", type=float, default=2.0, help="stop a run when the machine has less")
    common.add_argument(
        "--gib-per-peer",
        type=float,
        default=0.8,
        help="memory one trainer takes from the machine once it trains (a 6+10 storm: about 0.75 GiB)",
    )
    common.add_argument(
        "--lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="peers run with " + " ".join(f"{k}={v}" for k, v in LEAN_ENVIRONMENT.items()) + " (less memory)",
    )
    common.add_argument(
        "overrides",
        nargs="*",
        help="config overrides for every peer (key=value), e.g. collaboration.target_group_size=4 or "
        "collaboration.max_concurrent_state_uploads=1",
    )
    scale = sub.add_parser("scale", parents=[common], help="swarms of N trainers, one after another")
    scale.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16, 32], help="the swarm sizes N")
    scale.add_argument("--measure-seconds", type=float, default=120.0, help="the window once every peer contributed")
    scale.add_argument("--start-spacing", type=float, default=0.5, help="seconds between two trainers' starts")
    scale.add_argument("--append", action="store_true", help="add to the runs already in scale.json")
    report = sub.add_parser("report", parents=[common], help="re-read the run folders of scale.json's runs")
    report.set_defaults(peers=[])
    storm = sub.add_parser("storm", parents=[common], help="newcomers join a running swarm at once")
    storm.add_argument("--donors", type=int, default=6, help="trainers already training")
    storm.add_argument("--newcomers", type=int, default=10, help="trainers that join during the storm")
    storm.add_argument("--storm-seconds", type=float, default=5.0, help="the newcomers start within this")
    storm.add_argument("--before-seconds", type=float, default=60.0, help="the donors' baseline window")
    storm.add_argument(
        "--after-seconds",
        type=float,
        default=30.0,
        help="training on after the last newcomer joined (and until every newcomer is in a global step)",
    )
    storm.add_argument("--load-state-deadline", type=float, default=300.0, help="collaboration.load_state_deadline")
    storm.add_argument(
        "--donor-upload-mbit", type=float, default=None, help="every donor's upload cap instead of the paper's mix"
    )
    storm.add_argument("--storm-file", default="storm.json", help="the result's file name in --results")
    storm.add_argument("--seed", type=int, default=0, help="the newcomers' start offsets")
    args = parser.parse_args()
    args.run_dir = args.run_dir or ROOT / "outputs/scale" / args.mode
    return args


@exit_on_user_error
def main() -> None:
    args = parse_arguments()
    setup_logging("scale")
    stop = StopFlag().install()
    if args.mode == "storm" and args.run_dir.exists() and any(args.run_dir.iterdir()):
        raise UserError(f"{args.run_dir} is not empty: give a new --run-dir")
    if args.mode == "report":
        report_main(args)
    elif args.mode == "scale":
        existing = [
            args.run_dir / f"n{count:02d}" for count in args.peers if (args.run_dir / f"n{count:02d}").exists()
        ]
        if existing:
            raise UserError(f"{existing[0]} exists: give a new --run-dir")
        scale_main(args, stop)
    else:
        storm_main(args, stop)


if __name__ == "__main__":
    main()
