"""Collaborative vs HPC baseline on one machine: run each setup, read its history, evaluate, tabulate, plot.

Every setup trains the same task from the same config and seed for the same number of global steps of the same
global batch (so the same number of samples): one process, torch DDP with N gloo workers, and a local hivemind
swarm of N trainers under each semantics (``diloco`` once per chosen number of inner steps). Each setup writes the
common per-global-step history format (``history.jsonl``); the final models are scored on one fixed set of
evaluation batches, and so are its checkpoints along the way (held-out curves). While a setup runs, the TCP bytes
each of its processes sends are read from the kernel (``SocketBytes``; on emulated hosts, ``netns.HostTraffic``),
so setups are compared by what they put on the wire as well as by loss.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil
import torch

from common.checkpoints import CHECKPOINT_DIR, list_checkpoints, read_state_file
from common.config import RunConfig, import_task_module
from common.errors import DataError, PeerError
from common.lifecycle import StopFlag
from common.metrics import HistoryWriter
from common.roles.trainer import FINAL_STATE_FILE
from common.seeding import stable_seed
from common.swarm import ROOT, stop_process_group
from common.tools.netns import HostTraffic, NetworkSetup, ss_connections

logger = logging.getLogger(__name__)

SEMANTICS = ("sync", "dpu", "local")
BASELINE = "ddp"
PROGRESS_SECONDS = 15.0  # how often a running setup's progress is logged
SOCKET_POLL_SECONDS = 2.0  # how often the bytes a setup's processes sent are read (connections are long-lived)
RUN_RECORD = "run.json"  # written into a setup's run folder when it finished: what it ran and when


@dataclass(frozen=True)
class Setup:
    """One way of training the run: ``single``, ``ddp`` or a collaborative ``collab_<semantics>``."""

    name: str
    kind: str  # single | ddp | collaborative
    semantics: Optional[str] = None
    overrides: Tuple[str, ...] = ()  # this setup's own settings (diloco's inner_steps)

    def history_path(self, run_dir: Path) -> Path:
        return run_dir / ("monitor" if self.kind == "collaborative" else "") / "history.jsonl"

    def final_model_path(self, run_dir: Path) -> Path:
        folder = {"single": run_dir, "ddp": run_dir / "worker0", "collaborative": run_dir / "trainer0"}[self.kind]
        return folder / FINAL_STATE_FILE


def diloco_setup(inner_steps: int, outer_lr: Optional[float] = None) -> Setup:
    """``collab_diloco_h<H>``, or ``collab_diloco_h<H>_lr<outer lr>`` for an outer learning rate of its own."""
    if outer_lr is None:
        return Setup(
            f"collab_diloco_h{inner_steps}", "collaborative", "diloco", (f"collaboration.inner_steps={inner_steps}",)
        )
    return Setup(
        f"collab_diloco_h{inner_steps}_lr{outer_lr:g}",
        "collaborative",
        "diloco",
        (f"collaboration.inner_steps={inner_steps}", f"collaboration.outer_lr={outer_lr:g}"),
    )


def parse_diloco_setup(text: str) -> Tuple[int, Optional[float]]:
    """``H`` or ``H:OUTER_LR`` (--diloco-inner-steps); a ValueError names what is wrong."""
    steps, _, lr = text.partition(":")
    try:
        inner_steps, outer_lr = int(steps), (float(lr) if lr else None)
    except ValueError:
        raise ValueError(f"{text!r} is not H or H:OUTER_LR (e.g. 25 or 25:0.5)") from None
    if inner_steps < 1 or (outer_lr is not None and not outer_lr > 0):
        raise ValueError(f"{text!r}: H must be >= 1 and an outer lr > 0")
    return inner_steps, outer_lr


def all_setups(diloco_inner_steps: Sequence = ()) -> List[Setup]:
    """The setups a comparison can run; ``diloco_inner_steps``: a diloco swarm for each H, or (H, outer lr)."""
    return [
        Setup("single", "single"),
        Setup("single_dpu", "single", "dpu"),  # one process with dpu's one-step-stale updates: collab_dpu's reference
        Setup(BASELINE, "ddp"),
        *(Setup(f"collab_{semantics}", "collaborative", semantics) for semantics in SEMANTICS),
        *(diloco_setup(*(item if isinstance(item, tuple) else (item,))) for item in diloco_inner_steps),
    ]


@dataclass
class SetupRun:
    setup: Setup
    run_dir: Path
    launched: float  # unix time just before the setup's first process started
    finished: float
    exit_code: int
    bytes_sent: Dict[str, int] = field(default_factory=dict)  # TCP bytes sent per process label (SocketBytes)
    # on emulated hosts (a swarm with a network setup): each host's role, the bytes its link sent and its TCP
    # bytes per destination host (netns.HostTraffic); empty on loopback
    hosts: Dict[str, Dict] = field(default_factory=dict)

    def trainer_names(self) -> List[str]:
        """A swarm's trainers, by peer name (their run folders): the emulated hosts' or trainer<i>."""
        if self.hosts:
            return [name for name, host in self.hosts.items() if host["role"] == "trainer"]
        return sorted(path.name for path in self.run_dir.glob("trainer*") if path.is_dir())

    def final_model_path(self) -> Path:
        """The model a setup is scored by: the process's, DDP worker 0's, a swarm's first trainer's."""
        if self.setup.kind == "collaborative" and self.hosts:
            return self.run_dir / self.trainer_names()[0] / FINAL_STATE_FILE
        return self.setup.final_model_path(self.run_dir)

    def checkpoint_dir(self) -> Path:
        """Where the setup's checkpoints along the way are (the monitor's for a swarm)."""
        return self.setup.history_path(self.run_dir).parent / CHECKPOINT_DIR


class SocketBytes:
    """TCP bytes sent by a process tree, per peer, read from the kernel's socket statistics (``ss -tinp``).

    Every established TCP connection of the tree's processes is sampled every ``SOCKET_POLL_SECONDS``; a
    connection's count is the largest ``bytes_sent`` seen (retransmissions included: what went on the wire). A
    connection that opens and closes between two samples is missed, so the counts are lower bounds; hivemind's
    and gloo's connections last the whole run. Each connection is charged to the peer whose process owns it: the
    nearest ancestor whose command line names a peer (``--name X``: trainer0, monitor, ddp), labelled
    ``X@pid`` so that DDP's workers, which share a name, stay apart. Over loopback both ends of a connection are
    listed; each end is charged only to its own process.
    """

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.connections: Dict[Tuple[str, str, str], int] = {}  # (label, local, peer address) -> bytes sent
        self.labels: Dict[int, Optional[str]] = {}

    def _label(self, process: psutil.Process) -> Optional[str]:
        if process.pid not in self.labels:
            label = None
            try:
                for candidate in [process, *process.parents()]:
                    command = candidate.cmdline()
                    if "--name" in command[:-1]:
                        label = f"{command[command.index('--name') + 1]}@{candidate.pid}"
                        break
                    if candidate.pid == self.root_pid:
                        break
            except psutil.Error:
                pass
            self.labels[process.pid] = label
        return self.labels[process.pid]

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            tree = {process.pid: process for process in [root, *root.children(recursive=True)]}
        except psutil.Error:
            return
        try:
            listing = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for header, sent in ss_connections(listing):
            owners = [int(pid) for pid in re.findall(r"pid=(\d+)", " ".join(header[5:]))]
            owner = next((pid for pid in owners if pid in tree), None)
            label = self._label(tree[owner]) if owner is not None else None
            if label is not None:
                key = (label, header[3], header[4])
                self.connections[key] = max(self.connections.get(key, 0), sent)

    def per_peer(self) -> Dict[str, int]:
        totals: Dict[str, int] = {}
        for (label, _, _), sent in self.connections.items():
            totals[label] = totals.get(label, 0) + sent
        return totals


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_command(workers: int, config_path: str) -> List[str]:
    """The HPC baseline as a user starts it: torchrun runs ``workers`` processes of scripts/train.py on this machine,
    meeting on a free port; overrides follow."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={workers}",
        f"--master_port={free_port()}",
        "scripts/train.py",
        "--config",
        config_path,
    ]


def launch_command(
    setup: Setup,
    config_path: str,
    overrides: Sequence[str],
    run_dir: Path,
    workers: int,
    network_setup: Optional[str] = None,
) -> List[str]:
    """``network_setup``: a swarm's peers each run on their own emulated host of that setup (local_swarm.py
    --network-setup; the trainers are then its trainer hosts); one process and DDP stay on this machine."""
    if setup.kind == "single":
        return [
            sys.executable,
            "scripts/train.py",
            "--config",
            config_path,
            "--name",
            setup.name,
            *overrides,
            "training.backend=single",
            *([f"collaboration.semantics={setup.semantics}"] if setup.semantics else []),
            f"training.output_dir={run_dir}",
        ]
    if setup.kind == "ddp":
        return [
            *torchrun_command(workers, config_path),
            "--name",
            "ddp",
            *overrides,
            "training.backend=ddp",
            f"training.output_dir={run_dir}",
        ]
    run_label = (setup.name[len("collab_") :] if setup.overrides else setup.semantics).replace(".", "p")
    return [
        sys.executable,
        "scripts/local_swarm.py",
        "--config",
        config_path,
        "--trainers",
        str(workers),
        "--aux",
        "0",
        "--output",
        str(run_dir),
        "--timeout=inf",  # the comparison's own --timeout is the one limit: it stops the setup and says so
        *(["--network-setup", str(network_setup)] if network_setup else []),
        *overrides,
        "training.backend=collaborative",
        f"collaboration.semantics={setup.semantics}",
        *setup.overrides,
        f"collaboration.run_id=compare_{run_label}",
    ]


def run_setup(
    setup: Setup,
    config_path: str,
    overrides: Sequence[str],
    run_dir: Path,
    workers: int,
    max_steps: int,
    timeout: float,
    stop: StopFlag,
    inputs: str = "",
    network: Optional[EmulatedHosts] = None,
) -> SetupRun:
    """Run one setup in its own process group, logging its progress; stop the whole group on timeout or signal.
    ``inputs``: the task's input fingerprint, recorded so a later ``finished_run`` can tell if the inputs changed.
    ``network``: a swarm runs on these emulated hosts (``launch_command``), whose traffic is read per host."""
    run_dir.mkdir(parents=True, exist_ok=True)
    emulated = network if setup.kind == "collaborative" else None
    command = launch_command(setup, config_path, overrides, run_dir, workers, network_setup_path(emulated))
    log_path = run_dir / "launcher.log"
    launched = time.time()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    history = HistoryWriter(setup.history_path(run_dir).parent)
    last_log = last_poll = time.monotonic()
    # across namespaces a process's sockets are out of this one's sight: there each host's counters are read
    sockets = SocketBytes(process.pid) if emulated is None else HostTraffic(process.pid, host_names(emulated))
    try:
        while process.poll() is None:
            if time.monotonic() - last_poll >= SOCKET_POLL_SECONDS:
                sockets.sample()
                last_poll = time.monotonic()
            elapsed = time.time() - launched
            if elapsed > timeout or stop.is_set():
                raise PeerError(
                    f"setup {setup.name} did not finish within {timeout:.0f} s (log: {log_path})"
                    if not stop.is_set()
                    else f"stopped by {stop.signal_name} during setup {setup.name}"
                )
            if time.monotonic() - last_log >= PROGRESS_SECONDS:
                log_progress(setup, history.read(), elapsed, max_steps)
                last_log = time.monotonic()
            time.sleep(0.5)
    finally:
        stop_process_group(process, graceful=True, grace_seconds=20.0)
    if process.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-5:])
        raise PeerError(f"setup {setup.name} exited with code {process.returncode}: {tail}")
    if emulated is None:
        run = SetupRun(setup, run_dir, launched, time.time(), process.returncode, sockets.per_peer())
    else:
        hosts = host_traffic(emulated.setup, sockets)
        run = SetupRun(setup, run_dir, launched, time.time(), process.returncode, hosts=hosts)
    record = {
        "recipe": recipe(command),
        "inputs": inputs,
        "launched": run.launched,
        "finished": run.finished,
        "bytes_sent": run.bytes_sent,
        "hosts": run.hosts,
    }
    (run_dir / RUN_RECORD).write_text(json.dumps(record, indent=1))
    return run


@dataclass(frozen=True)
class EmulatedHosts:
    """A swarm's emulated hosts: the network setup file (handed to local_swarm.py) and what it holds."""

    path: str
    setup: NetworkSetup


def network_setup_path(network: Optional[EmulatedHosts]) -> Optional[str]:
    return network.path if network is not None else None


def host_names(network: EmulatedHosts) -> List[str]:
    return [host.name for host in network.setup.hosts]


def host_traffic(network: NetworkSetup, traffic: HostTraffic) -> Dict[str, Dict]:
    """Per emulated host: its role, the bytes its link sent, and its TCP bytes per destination host."""
    sent_to = traffic.tcp_sent_to()
    return {
        host.name: {
            "role": host.role,
            "link_bytes_sent": traffic.link_sent.get(host.name, 0),
            "tcp_bytes_sent_to": sent_to.get(host.name, {}),
        }
        for host in network.hosts
    }


def recipe(command: Sequence[str]) -> List[str]:
    """A launch command without what differs between two launches of the same run (torchrun's free port)."""
    return [part for part in command if not part.startswith("--master_port=")]


def finished_run(
    setup: Setup,
    config_path: str,
    overrides: Sequence[str],
    run_dir: Path,
    workers: int,
    inputs: str = "",
    network: Optional[EmulatedHosts] = None,
) -> Optional[SetupRun]:
    """The run already in ``run_dir`` if it finished with exactly the command this comparison would launch, on
    the same inputs (``inputs``: the task's input fingerprint, e.g. its tokenizer's numbering).

    Lets a long comparison resume after an interruption, or run its setups at different times (e.g. the
    baselines while the machine is busy with something else); any difference in the command reruns the setup,
    and so do other inputs: a model trained on other token ids would be scored on batches it cannot read.
    """
    record_path = run_dir / RUN_RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    emulated = network if setup.kind == "collaborative" else None
    command = launch_command(setup, config_path, overrides, run_dir, workers, network_setup_path(emulated))
    if record.get("recipe") != recipe(command):
        return None
    if record.get("inputs", "") != inputs:
        logger.info(f"{setup.name}: the finished run in {run_dir} was trained on other inputs; running it again")
        return None
    sent, hosts = record.get("bytes_sent", {}), record.get("hosts", {})
    return SetupRun(setup, run_dir, record["launched"], record["finished"], 0, sent, hosts)


def log_progress(setup: Setup, history: List[dict], elapsed: float, max_steps: int) -> None:
    if not history:
        logger.info(f"{setup.name}: {elapsed:.0f} s, starting (loading data, joining peers)")
        return
    done = history[-1]["step"] + 1
    eta = (max_steps - done) * elapsed / done
    logger.info(
        f"{setup.name}: global step {done}/{max_steps} | loss {history[-1]['loss']:.4f} | "
        f"elapsed {elapsed:.0f} s | ETA {eta:.0f} s"
    )


def curve_rows(run: SetupRun) -> List[Dict]:
    """One row per global step: samples seen so far and seconds since the setup was launched."""
    history = HistoryWriter(run.setup.history_path(run.run_dir).parent).read()
    rows, samples_seen = [], 0
    for entry in sorted(history, key=lambda item: item["step"]):
        samples_seen += entry["samples"]
        rows.append(
            {
                "setup": run.setup.name,
                "step": entry["step"],
                "peers": entry["peers"],
                "samples_seen": samples_seen,
                "wall_seconds": round(entry["time"] - run.launched, 3),
                "loss": entry["loss"],
                **{name: entry["metrics"].get(name) for name in sorted(entry["metrics"])},
            }
        )
    return rows


def evaluation_batches(config: RunConfig, count: int) -> tuple:
    """The task (for its forward), ``count`` fixed evaluation batches and what they are: the task's held-out split
    (documents no setup trained on) when it keeps one, else a stream of the training corpus no setup draws."""
    task = import_task_module(config.task_module).build_task(config)
    heldout = task.heldout_batches(count)
    if heldout is not None:
        return task, heldout, "held-out documents (never trained on)"
    stream = task.batches(stable_seed(config.training.seed, "comparison-evaluation"))
    return task, [next(stream) for _ in range(count)], "the training corpus, in an order no setup trains with"


def evaluate(task, batches: List[dict], state_path: Path) -> Dict[str, float]:
    """Sample-weighted mean loss and metrics of the saved model over the fixed evaluation batches."""
    if not state_path.is_file():
        raise DataError(f"no final model at {state_path}: that run did not finish (its logs: {state_path.parent})")
    try:
        state = torch.load(state_path, map_location="cpu")
    except Exception as error:  # a truncated or foreign file: unpickling fails in many ways
        raise DataError(f"cannot read the final model {state_path}: {type(error).__name__}: {error}") from None
    return evaluate_weights(task, batches, state)


def evaluate_weights(task, batches: List[dict], weights: dict) -> Dict[str, float]:
    """``evaluate`` for a model state dict in memory."""
    task.model.load_state_dict(weights)
    task.model.eval()
    totals: Dict[str, float] = {}
    samples = 0
    with torch.no_grad():
        for batch in batches:
            output = task.forward(task.model, batch)
            for name, value in {"loss": float(output.loss), **output.metrics}.items():
                totals[name] = totals.get(name, 0.0) + value * output.batch_size
            samples += output.batch_size
    return {name: total / samples for name, total in totals.items()}


def heldout_curve(run: SetupRun, task, batches: List[dict]) -> List[Dict]:
    """Held-out loss and metrics along the run: each checkpoint the setup saved (a swarm's: the monitor's, of the
    state the swarm served; diloco's: its outer parameters) and the final model, each at the samples the run had
    seen and the wall time it had taken when it reached that global step (from its history)."""
    rows = curve_rows(run)
    points = []
    for path in list_checkpoints(run.checkpoint_dir()):
        state = read_state_file(path)
        points.append((int(state["step"]), "checkpoint", state["model"]))
    if rows:
        points.append((rows[-1]["step"] + 1, "final", torch.load(run.final_model_path(), map_location="cpu")))
    curve = []
    for steps_done, source, weights in points:
        reached = [row for row in rows if row["step"] < steps_done]
        if not reached:
            continue  # a checkpoint of the initial state: no samples seen yet
        evaluation = evaluate_weights(task, batches, weights)
        curve.append(
            {
                "setup": run.setup.name,
                "global_steps": steps_done,
                "source": source,
                "samples_seen": reached[-1]["samples_seen"],
                "wall_seconds": reached[-1]["wall_seconds"],
                "eval_loss": evaluation["loss"],
                **{f"eval_{name}": value for name, value in sorted(evaluation.items()) if name != "loss"},
            }
        )
    return curve


def worker_summaries(run: SetupRun) -> List[Dict]:
    """The summary.json of each process that trained (the single process, each DDP worker, each trainer)."""
    folders = {
        "single": [run.run_dir],
        "ddp": sorted(run.run_dir.glob("worker*")),
        "collaborative": [run.run_dir / name for name in run.trainer_names()],
    }[run.setup.kind]
    paths = [folder / "summary.json" for folder in folders]
    return [json.loads(path.read_text()) for path in paths if path.is_file()]


def traffic_and_utilisation(run: SetupRun, samples: int) -> Dict:
    """Bytes the training processes sent (the monitor's excluded: it only reads records and checkpoints), per
    sample trained, which is also each trainer's bytes per sample of its own when trainers share the work evenly;
    and the trainers' mean compute utilisation (share of wall time in forward and backward passes) and share of
    computed samples that entered a global step."""
    trainers = {label: sent for label, sent in run.bytes_sent.items() if not label.startswith("monitor@")}
    wire = {}
    if run.hosts:
        trainers, wire = trainer_host_bytes(run.hosts)
    summaries = worker_summaries(run)
    total = sum(trainers.values())

    def mean(key: str) -> Optional[float]:
        values = [summary[key] for summary in summaries if summary.get(key) is not None]
        return statistics.fmean(values) if values else None

    return {
        "mb_sent_per_trainer": total / max(len(trainers), 1) / 1e6 if run.setup.kind != "single" else 0.0,
        "bytes_sent_per_sample": total / samples if samples and run.setup.kind != "single" else 0.0,
        "link_bytes_sent_per_sample": sum(wire.values()) / samples if wire and samples else None,
        "compute_share": mean("compute_share"),
        "used_share": mean("used_share"),
    }


def trainer_host_bytes(hosts: Dict[str, Dict]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """On emulated hosts, per trainer: the TCP bytes it sent to the swarm (to trainers and auxiliary peers: what
    training costs; what it sent the monitor, the history and checkpoint downloads, is left out), and every byte
    its link sent (headers, the monitor's share and short connections included)."""
    roles = {name: host["role"] for name, host in hosts.items()}
    swarm, link = {}, {}
    for name, host in hosts.items():
        if host["role"] != "trainer":
            continue
        swarm[name] = sum(
            sent for destination, sent in host["tcp_bytes_sent_to"].items() if roles.get(destination) != "monitor"
        )
        link[name] = host["link_bytes_sent"]
    return swarm, link


def summarize(run: SetupRun, rows: List[Dict], evaluation: Dict[str, float], tail_steps: int = 3) -> Dict:
    total_samples = rows[-1]["samples_seen"] if rows else 0
    steady_seconds = rows[-1]["wall_seconds"] - rows[0]["wall_seconds"] if rows else 0.0
    return {
        "setup": run.setup.name,
        "steps": len(rows),
        "samples": total_samples,
        "train_loss_last_steps": statistics.fmean(row["loss"] for row in rows[-tail_steps:]) if rows else None,
        "eval_loss": evaluation["loss"],
        **{f"eval_{name}": value for name, value in sorted(evaluation.items()) if name != "loss"},
        "wall_seconds": round(run.finished - run.launched, 1),
        "samples_per_second_end_to_end": total_samples / (run.finished - run.launched),
        # the first step's samples were accumulated before its timestamp: count only the steps after it
        "samples_per_second_steady": (
            (total_samples - rows[0]["samples_seen"]) / steady_seconds
            if len(rows) > 1 and steady_seconds > 0
            else None
        ),
        **traffic_and_utilisation(run, total_samples),
    }


# A swarm's own reference: one process applying updates the same way (dpu: one global step late)
SAME_UPDATES_IN_ONE_PROCESS = {"collab_sync": "single", "collab_dpu": "single_dpu"}


def add_baseline_differences(summaries: List[Dict]) -> None:
    """eval_loss_vs_ddp_percent for every setup; eval_loss_vs_one_process_percent for the swarms whose update rule
    one process can follow, so a swarm's gap is told apart from its update rule's."""
    by_name = {summary["setup"]: summary for summary in summaries}

    def percent_above(summary: Dict, reference: Optional[Dict]) -> Optional[float]:
        if reference is None:
            return None
        return 100.0 * (summary["eval_loss"] - reference["eval_loss"]) / reference["eval_loss"]

    for summary in summaries:
        summary["eval_loss_vs_ddp_percent"] = percent_above(summary, by_name.get(BASELINE))
        reference = by_name.get(SAME_UPDATES_IN_ONE_PROCESS.get(summary["setup"], ""))
        summary["eval_loss_vs_one_process_percent"] = percent_above(summary, reference)


def interpolate(points: List[Tuple[float, float]], x: float) -> Optional[float]:
    """The piecewise-linear value at ``x`` of points sorted by x; None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


def equal_sample_metrics(heldout: List[Dict]) -> List[str]:
    """The task's quality metrics in its held-out rows, as its evaluation named them: ``eval_*`` but no loss."""
    return sorted({key for row in heldout for key in row if key.startswith("eval_") and not key.endswith("_loss")})


def add_equal_sample_scores(summaries: List[Dict], heldout: List[Dict], reference: str = "collab_sync") -> None:
    """Setups count different samples into the same global steps (a swarm keeps computing while a step boundary is
    agreed): each setup's held-out loss and accuracy read off its held-out curve at the samples every setup
    reached (the fewest any setup's final model saw), and bytes per sample against ``reference``'s."""
    ends = [max(row["samples_seen"] for row in heldout if row["setup"] == s["setup"]) for s in summaries]
    common = min(ends) if heldout and all(ends) else None
    by_name = {summary["setup"]: summary for summary in summaries}
    for summary in summaries:
        own = sorted((row for row in heldout if row["setup"] == summary["setup"]), key=lambda row: row["samples_seen"])
        for metric in ("eval_loss", *equal_sample_metrics(heldout)):
            points = [(row["samples_seen"], row[metric]) for row in own if row.get(metric) is not None]
            summary[f"{metric}_at_equal_samples"] = interpolate(points, common) if points and common else None
        summary["equal_samples"] = common
    base = by_name.get(reference)
    for summary in summaries:
        loss, base_loss = summary["eval_loss_at_equal_samples"], (base or {}).get("eval_loss_at_equal_samples")
        summary["eval_loss_at_equal_samples_vs_sync_percent"] = (
            100.0 * (loss - base_loss) / base_loss if loss is not None and base_loss else None
        )
        sent, base_sent = summary.get("bytes_sent_per_sample"), (base or {}).get("bytes_sent_per_sample")
        summary["bytes_per_sample_times_fewer_than_sync"] = base_sent / sent if sent and base_sent else None


def write_csv(path: Path, rows: List[Dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {key: (f"{value:.6g}" if isinstance(value, float) else value) for key, value in row.items()}
            )


def plot_title(setups: List[Setup], steps: int, target: int, workers: int, trainers: int) -> str:
    """The figure's title, naming worker counts only for the kinds of setup that ran."""
    kinds = {setup.kind for setup in setups}
    parts = [f"tiny ALBERT, {steps} steps x {target} samples"]
    if "ddp" in kinds:
        parts.append(f"{workers} DDP workers")
    if "collaborative" in kinds:
        parts.append(f"{trainers} trainers")
    return ", ".join(parts)


def plot_curves(rows: List[Dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for setup in dict.fromkeys(row["setup"] for row in rows):
        own = [row for row in rows if row["setup"] == setup]
        style = {"linestyle": "--"} if setup in ("single", "single_dpu", BASELINE) else {}
        by_samples.plot([row["samples_seen"] for row in own], [row["loss"] for row in own], label=setup, **style)
        by_time.plot([row["wall_seconds"] for row in own], [row["loss"] for row in own], label=setup, **style)
    by_samples.set_xlabel("samples seen")
    by_samples.set_ylabel("training loss of the global step")
    by_time.set_xlabel("wall time since launch (s)")
    for axis in (by_samples, by_time):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_heldout(rows: List[Dict], path: Path, title: str) -> None:
    """Held-out loss and the task's first other metric (e.g. an accuracy) against samples and wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["eval_loss", *sorted({key for row in rows for key in row if key.startswith("eval_")} - {"eval_loss"})]
    metrics = [name for name in metrics if not name.endswith("_loss") or name == "eval_loss"][:2]
    figure, axes = plt.subplots(len(metrics), 2, figsize=(12, 4.2 * len(metrics)), squeeze=False)
    for setup in dict.fromkeys(row["setup"] for row in rows):
        own = [row for row in rows if row["setup"] == setup]
        style = {"linestyle": "--"} if setup in ("single", "single_dpu", BASELINE) else {}
        for line, metric in zip(axes, metrics):
            for axis, x in zip(line, ("samples_seen", "wall_seconds")):
                xs, ys = [row[x] for row in own], [row[metric] for row in own]
                axis.plot(xs, ys, marker="o", ms=3, label=setup, **style)
    for line, metric in zip(axes, metrics):
        line[0].set_ylabel(f"held-out {metric[len('eval_') :].replace('_', ' ')}")
        line[0].set_xlabel("samples seen")
        line[1].set_xlabel("wall time since launch (s)")
        for axis in line:
            axis.grid(alpha=0.3)
    axes[0][1].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def summary_table(summaries: List[Dict]) -> str:
    def number(value, digits):
        return "n/a" if value is None else f"{value:.{digits}f}"

    def percent(value):
        return "n/a" if value is None else f"{100 * value:.0f} %"

    # the task's quality metrics as its evaluation named them (eval_*), losses left to the total
    metrics = sorted(
        {
            key
            for summary in summaries
            for key in summary
            if key.startswith("eval_")
            and key not in ("eval_loss", "eval_loss_vs_ddp_percent", "eval_loss_vs_one_process_percent")
            and not key.endswith("_loss")
            and "_at_equal_samples" not in key
        }
    )
    links = any(summary.get("link_bytes_sent_per_sample") is not None for summary in summaries)
    equal = any(summary.get("equal_samples") for summary in summaries)
    at_equal = sorted(  # the quality metrics read off the held-out curves at equal samples
        {
            key[: -len("_at_equal_samples")]
            for summary in summaries
            for key in summary
            if key.endswith("_at_equal_samples") and key != "eval_loss_at_equal_samples"
        }
    )
    header = [
        "setup",
        "steps",
        "samples",
        "eval loss",
        "vs ddp",
        "vs one process, same updates",
        *(
            [
                f"eval loss at {summaries[0]['equal_samples']} samples",
                "vs sync at equal samples",
                *(f"{name[len('eval_') :].replace('_', ' ')} at equal samples" for name in at_equal),
            ]
            if equal
            else []
        ),
        "last-3-step train loss",
        *(name[len("eval_") :] for name in metrics),
        "samples/s steady",
        "samples/s end-to-end",
        "wall s",
        "bytes sent per sample",
        *(["link bytes sent per sample"] if links else []),
        *(["bytes per sample: x fewer than sync"] if equal else []),
        "MB sent per trainer",
        "computing",
        "samples used",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for summary in summaries:
        cells = [
            summary["setup"],
            summary["steps"],
            summary["samples"],
            number(summary["eval_loss"], 4),
            *(
                "n/a" if difference is None else f"{difference:+.2f} %"
                for difference in (summary["eval_loss_vs_ddp_percent"], summary["eval_loss_vs_one_process_percent"])
            ),
            *(
                [
                    number(summary["eval_loss_at_equal_samples"], 4),
                    "n/a"
                    if summary["eval_loss_at_equal_samples_vs_sync_percent"] is None
                    else f"{summary['eval_loss_at_equal_samples_vs_sync_percent']:+.2f} %",
                    *(number(summary.get(f"{name}_at_equal_samples"), 3) for name in at_equal),
                ]
                if equal
                else []
            ),
            number(summary["train_loss_last_steps"], 4),
            *(number(summary.get(name), 3) for name in metrics),
            number(summary["samples_per_second_steady"], 1),
            number(summary["samples_per_second_end_to_end"], 1),
            summary["wall_seconds"],
            number(summary.get("bytes_sent_per_sample"), 0),
            *([number(summary.get("link_bytes_sent_per_sample"), 0)] if links else []),
            *([number(summary.get("bytes_per_sample_times_fewer_than_sync"), 1)] if equal else []),
            number(summary.get("mb_sent_per_trainer"), 1),
            percent(summary.get("compute_share")),
            percent(summary.get("used_share")),
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)
