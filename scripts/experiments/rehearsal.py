"""Dress rehearsal of the paper configs at their real model and input shapes, on this machine's CPU.

For each config: the data is prepared once (time and peak RSS measured), then a monitor and 2 trainers (sahajBERT:
plus one auxiliary peer, trainer0 and the joiner in client mode, trainer1 accepting connections: no client-mode or
auxiliary peer serves its state) take ``--steps`` global steps with small local and target batches; the monitor
checkpoints every step and exports; the export is reloaded and compared with the checkpoint; a late joiner
downloads the swarm's state from the running peers and is compared with a state of the same step.
The DDP baseline runs as torchrun with 2 workers, checkpoints, exports the checkpoint and resumes from it.

Overrides are only batch sizes, step counts, data location (offline stand-ins: Wikipedia leads, Fashion-MNIST
written as PNG files, the Bengali stand-ins) and, because this machine has no GPU, ``training.precision=auto``
(fp32 on a CPU), SwAV's loader workers (1 instead of 8 per trainer: this machine's memory), the DDP workers'
threads (1 instead of 4: 2 cores) and the tokenizer (the hub's albert-large-v2 tokenizer is unreachable: one is
trained on the corpus with the same 30,000 pieces).

  python scripts/experiments/rehearsal.py --output paper_results/fullscale            # every config
  python scripts/experiments/rehearsal.py --configs swav_resnet50 --output outputs/r  # one

Results: ``<output>/rehearsal.csv`` (one row per config) and ``rehearsal.json`` (with commands, logs' tails, the
machine and date); peer folders under ``--runs``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import logging
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import torch

from common.checkpoints import CHECKPOINT_DIR, list_checkpoints, read_state_file
from common.config import CONFIG_KEYS_HELP, load_config
from common.optimizer import averaged_buffers
from common.swarm import LocalSwarm, trainer_stop_seconds
from common.task import EXPORT_DIR
from common.tools.comparison import torchrun_command
from common.tools.provenance import load_average

logger = logging.getLogger("rehearsal")
ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
COLUMNS = [
    "config",
    "model",
    "inputs",
    "peers",
    "steps",
    "s_per_step",
    "data_prep_s",
    "data_prep_peak_pss_mb",
    "trainer_peak_rss_mb",
    "monitor_peak_rss_mb",
    "run_peak_pss_mb",
    "checkpoint_step",
    "checkpoint_mb",
    "state_download_mb_fp16",
    "export_reloaded",
    "export_max_abs_diff",
    "late_joiner",
    "late_joiner_step",
    "late_joiner_max_abs_diff",
    "batchnorm_trained",
    "wall_s",
    "status",
]
# the trainers of a swarm rehearsal run until the late joiner has joined and stepped; at most this many steps more
LATE_JOIN_STEP_BOUND = 20
PNG_IMAGES = 640  # Fashion-MNIST train images written as an ImageFolder (10 class folders)


@dataclass
class Rehearsal:
    name: str
    config: str
    model: str
    inputs: str
    overrides: List[str]
    ddp: bool = False
    auxiliary: bool = False  # trainers in client mode need a full peer in each averaging group
    peer_overrides: Dict[str, List[str]] = field(default_factory=dict)


def rehearsals(data_dir: Path) -> Dict[str, Rehearsal]:
    common = ["training.precision=auto", "training.max_global_steps={steps}", "monitor.wandb_mode=disabled"]
    albert_data = ["task.corpus=offline_wikipedia", "task.tokenizer=train"]
    bengali = [
        "task.stream.sources=[.cache/bengali/wikipedia_standin,.cache/bengali/oscar_standin]",
        "task.stream.source_configs=[null,null]",
    ]
    swarm = ["collaboration.expected_peers=2", "monitor.checkpoint_every_steps=1"]
    return {
        "albert_large": Rehearsal(
            "albert_large",
            "configs/albert/paper.yaml",
            "ALBERT-large (hidden 1024, 24 layers, vocab 30,000)",
            "seq 512",
            [*common, *albert_data, *swarm, "training.local_batch_size=1", "collaboration.target_batch_size=2"],
        ),
        "albert_large_ddp": Rehearsal(
            "albert_large_ddp",
            "configs/albert/baseline_paper.yaml",
            "ALBERT-large, torch DDP (gloo) x 2 workers",
            "seq 512",
            [
                *common,
                *albert_data,
                "training.local_batch_size=1",
                "collaboration.target_batch_size=2",
                "training.checkpoint_every_steps=1",
                # the config's 4 threads per worker are for a GPU host's collation; 2 workers x 4 OpenMP threads on
                # 2 shared cores spun in gemm's barriers: no step in 8 minutes (run of 10:54, paper_results/fullscale)
                "training.num_threads=1",
            ],
            ddp=True,
        ),
        "swav_resnet50": Rehearsal(
            "swav_resnet50",
            "configs/swav/paper.yaml",
            "SwAV ResNet-50 + [2048, 2048, 128] head + 3,000 prototypes",
            "2x224 + 6x96 crops",
            [
                *common,
                *swarm,
                f"task.dataset={data_dir / 'fashion_mnist_png'}",
                "training.local_batch_size=2",
                # the config's 8 loader processes per trainer are sized for a GPU host; 3 peers x 8 on this shared
                # 2-core, 23 GB machine ran it out of memory (the kernel killed a trainer)
                "training.dataloader_workers=1",
                "collaboration.target_batch_size=4",
            ],
        ),
        "sahajbert": Rehearsal(
            "sahajbert",
            "configs/sahajbert/paper.yaml",
            "ALBERT-large (vocab 32,000), trainers in client mode but one + 1 auxiliary",
            "seq 512",
            [*common, *bengali, *swarm, "training.local_batch_size=1", "collaboration.target_batch_size=2"],
            auxiliary=True,
            # hivemind serves a peer's state only from peers that accept connections and step (not client mode, not
            # auxiliary): with every trainer in client mode the monitor never got a state past step 0 (run of
            # 11:15, paper_results/fullscale), so one trainer is a volunteer with a reachable address; the late
            # joiner is in client mode, as the config's volunteers are
            peer_overrides={
                "monitor": ["network.client_mode=false"],
                "aux": ["network.client_mode=false"],
                "trainer1": ["network.client_mode=false"],
            },
        ),
    }


def write_fashion_mnist_pngs(folder: Path, count: int) -> Path:
    """Fashion-MNIST train images as PNG files in an ImageNet-layout folder (one folder per class)."""
    from PIL import Image

    from swav.data import FASHION_MNIST_CLASSES, load_fashion_mnist

    if folder.is_dir() and len(list(folder.glob("*/*.png"))) == count:
        return folder
    images, labels = load_fashion_mnist("train")
    for index in range(count):
        class_folder = folder / FASHION_MNIST_CLASSES[labels[index]].replace("/", "_").replace(" ", "_")
        class_folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[index]).save(class_folder / f"{index:05d}.png")
    return folder


def peak_rss_mb(pid: int) -> Optional[float]:
    """The process's peak resident set so far (VmHWM), while it runs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def prepare_data(rehearsal: Rehearsal, overrides: List[str], log: Path) -> tuple:
    """Build the task with its data once in a child process (tokenizer, examples, image index), as each
    volunteer does before contributing: wall seconds and the peak memory (summed PSS) of the child and the
    workers it starts, sampled every 0.5 s."""
    code = (
        "import sys; sys.path.insert(0, '.');"
        "from common.config import load_config, import_task_module;"
        f"config = load_config({rehearsal.config!r}, {overrides!r});"
        "import_task_module(config.task_module).build_task(config)"
    )
    started, peak = time.monotonic(), 0.0
    with log.open("wb") as stream:
        child = subprocess.Popen([PYTHON, "-c", code], cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT)
        try:
            while child.poll() is None:
                peak = max(peak, group_pss_mb(child.pid))
                if time.monotonic() - started > 3600:
                    raise TimeoutError("data preparation ran past 3600 s")
                time.sleep(0.5)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    seconds = time.monotonic() - started
    if child.returncode != 0:
        raise RuntimeError(f"data preparation failed (exit {child.returncode}): see {log}")
    return seconds, peak


def max_abs_diff(first: dict, second: dict, names) -> float:
    return max(float((first[name].float() - second[name].float()).abs().max()) for name in names)


def state_download_mb(checkpoint: dict) -> float:
    """What a joiner downloads with fp16 state compression: parameters, averaged buffers, optimizer statistics."""
    tensors = [value for value in checkpoint["model"].values() if value.is_floating_point()]
    for state in checkpoint["optimizer"]["state"].values():
        tensors += [value for value in state.values() if torch.is_tensor(value) and value.numel() > 1]
    return sum(tensor.numel() for tensor in tensors) * 2 / 2**20


def check_export(rehearsal: Rehearsal, config, folder: Path, checkpoint: dict) -> float:
    """Reload the exported model and return its largest difference from the checkpoint's weights."""
    if config.task_module == "swav":
        from swav.task import load_exported_trunk

        trunk = load_exported_trunk(folder, config.task).state_dict()
        reference = {
            name[len("trunk.") :]: value for name, value in checkpoint["model"].items() if name.startswith("trunk.")
        }
        return max_abs_diff(trunk, reference, [name for name, value in trunk.items() if value.is_floating_point()])
    from transformers import AlbertForPreTraining

    exported = AlbertForPreTraining.from_pretrained(str(folder)).state_dict()
    names = [name for name in checkpoint["model"] if name in exported and exported[name].is_floating_point()]
    return max_abs_diff(exported, checkpoint["model"], names)


def batchnorm_trained(config, checkpoint: dict) -> str:
    """For models with BatchNorm: did the checkpoint's running statistics move from their initial values?"""
    from common.config import import_task_module

    torch.manual_seed(config.training.seed)
    model = import_task_module(config.task_module).build_task(config, with_data=False).model
    ids = {id(buffer) for buffer in averaged_buffers(model)}
    names = [name for name, buffer in model.named_buffers() if id(buffer) in ids]
    if not names:
        return "no BatchNorm"
    moved = max_abs_diff(checkpoint["model"], model.state_dict(), names)
    return f"yes ({moved:.3g})" if moved > 1e-3 else f"NO ({moved:.3g})"


def checkpoint_step(path: Path) -> int:
    return int(path.stem.split("_")[1])


def newest_checkpoint_step(folder: Path) -> int:
    checkpoints = list_checkpoints(folder / "monitor" / "checkpoints")
    return checkpoint_step(checkpoints[-1]) if checkpoints else -1


def group_pss_mb(pid: int) -> float:
    """Memory of a peer's process tree now (its hivemind and loader children included), as summed PSS: pages the
    processes share (libraries, shared tensors) counted once, so the sum over peers is what the run uses."""
    try:
        members = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for member in members:
        try:
            total += member.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


LOADED = "loaded the swarm's state: continuing from global step "


def joiner_loaded_step(log: Path) -> Optional[int]:
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if LOADED in line:
            return int(line.split(LOADED)[1].split()[0])
    return None


def steps_done(folder: Path) -> int:
    """Global steps a peer has recorded taking part in (its steps.jsonl), counted as the step it reached."""
    path = folder / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] + 1 for line in lines if line.strip()), default=0)


def compare_late_joiner(folder: Path) -> str:
    """The joiner's final weights against a state of the same global step: a trainer's final weights or one of
    the monitor's checkpoints (peers stopped together can end a step apart: one finishes a step while stopping)."""
    late_steps = json.loads((folder / "late" / "summary.json").read_text())["global_steps"]
    late = read_state_file(folder / "late" / "final_model.pt")
    candidates = {}
    for name in ("trainer0", "trainer1"):
        steps = json.loads((folder / name / "summary.json").read_text())["global_steps"]
        candidates.setdefault(steps, (name, lambda name=name: read_state_file(folder / name / "final_model.pt")))
    for path in list_checkpoints(folder / "monitor" / "checkpoints"):
        candidates.setdefault(
            checkpoint_step(path), (f"monitor's {path.name}", lambda path=path: read_state_file(path)["model"])
        )
    if late_steps not in candidates:
        return f"no state of step {late_steps} to compare with (have {sorted(candidates)})"
    name, load = candidates[late_steps]
    reference = load()
    names = [key for key, value in reference.items() if value.is_floating_point()]
    return f"{max_abs_diff(late, reference, names):.3g} (vs {name})"


def run_swarm(rehearsal: Rehearsal, overrides: List[str], folder: Path, timeout: float, row: dict) -> None:
    """Monitor + 2 trainers take ``steps`` global steps and go on; once the monitor holds a checkpoint of step 1 or
    later, the late joiner starts, downloads the state from the running swarm and takes a step with it; then the
    trainers and the joiner are stopped together (SIGTERM: each finishes its micro-batch and saves its weights)."""
    peaks: Dict[str, float] = {}
    total_peak = [0.0]
    trainers_alive_when_loaded: List[bool] = []
    trainers = ["trainer0", "trainer1"]
    target = row["steps_target"]
    # the trainers run until stopped; this bound only ends a rehearsal whose joiner never joins
    open_ended = [f"training.max_global_steps={target + LATE_JOIN_STEP_BOUND}"]

    def sample(swarm: LocalSwarm) -> None:
        total = 0.0
        for name, peer in swarm.peers.items():
            value = peak_rss_mb(peer.process.pid)
            if value is not None:
                peaks[name] = max(peaks.get(name, 0.0), value)
            total += group_pss_mb(peer.process.pid)
        total_peak[0] = max(total_peak[0], total)
        if "late" in swarm.peers and not trainers_alive_when_loaded:
            if joiner_loaded_step(swarm.peers["late"].log_path) is not None:
                trainers_alive_when_loaded.append(all(swarm.peers[name].alive() for name in trainers))

    def joined_and_stepped(swarm: LocalSwarm) -> bool:
        """The joiner has loaded the state and both it and trainer0 have taken a step after it (and the swarm
        has taken ``steps``); or the joiner has exited (failed)."""
        late = swarm.peers["late"]
        if not late.alive():
            return steps_done(folder / "trainer0") >= target
        loaded = joiner_loaded_step(late.log_path)
        return (
            loaded is not None
            and steps_done(late.output_dir) > loaded
            and steps_done(folder / "trainer0") >= max(target, loaded + 1)
        )

    config_path = str(ROOT / rehearsal.config)
    with LocalSwarm(config_path, folder, overrides) as swarm:
        swarm.start_first_peer("monitor", "monitor", rehearsal.peer_overrides.get("monitor", []), timeout=600)
        if rehearsal.auxiliary:
            # it runs as long as the trainers do: client-mode trainers average only in a group with a full peer
            swarm.start("auxiliary", "aux", [*rehearsal.peer_overrides.get("aux", []), *open_ended])
        for name in trainers:
            swarm.start("trainer", name, [*rehearsal.peer_overrides.get(name, []), *open_ended])
        deadline = time.monotonic() + timeout
        swarm.wait(
            trainers,
            timeout,
            on_tick=lambda: sample(swarm),
            tick_seconds=1.0,
            should_stop=lambda: newest_checkpoint_step(folder) >= 1,
        )
        started_late = all(swarm.peers[name].alive() for name in trainers)
        everyone = [*trainers, *(["late"] if started_late else [])]
        if started_late:
            swarm.start("trainer", "late", ["collaboration.expected_peers=1", *open_ended])
            swarm.wait(
                everyone,
                max(60.0, deadline - time.monotonic()),
                on_tick=lambda: sample(swarm),
                tick_seconds=1.0,
                should_stop=lambda: joined_and_stepped(swarm),
            )
        sample(swarm)
        # 180 s killed sahajBERT's trainer1 3 s early (run of 11:48)
        averaging_timeout = load_config(config_path, overrides).collaboration.averaging_timeout
        swarm.stop_many(everyone, graceful=True, grace_seconds=trainer_stop_seconds(averaging_timeout))
        problems = [f"{name} exit {swarm.peers[name].process.returncode}" for name in everyone]
        problems = [problem for problem in problems if not problem.endswith(" exit 0")]
        if not started_late:
            problems.append("the trainers ended before the monitor's first checkpoint: no late joiner")
        swarm.stop("monitor")
        if rehearsal.auxiliary:
            swarm.stop("aux")
    row["trainer_peak_rss_mb"] = round(max(peaks.get(name, 0.0) for name in trainers))
    row["monitor_peak_rss_mb"] = round(peaks.get("monitor", 0.0))
    if rehearsal.auxiliary:
        row["monitor_peak_rss_mb"] = f"{row['monitor_peak_rss_mb']} (aux {round(peaks.get('aux', 0.0))})"
    row["run_peak_pss_mb"] = round(total_peak[0])
    steps = [json.loads(line) for line in (folder / "trainer0" / "steps.jsonl").read_text().splitlines()]
    row["steps"] = max((step["step"] + 1 for step in steps), default=0)
    row["s_per_step"] = round(sum(step["seconds"] for step in steps) / max(len(steps), 1), 1)
    checkpoints = list_checkpoints(folder / "monitor" / "checkpoints")
    if not checkpoints:
        row["status"] = "; ".join([*problems, "no monitor checkpoint"])
        return
    checkpoint = read_state_file(checkpoints[-1])
    row["checkpoint_step"] = checkpoint_step(checkpoints[-1])
    config = load_config(config_path, overrides)
    fill_checkpoint_columns(rehearsal, config, row, checkpoints[-1], checkpoint, folder / "monitor" / EXPORT_DIR)
    late_ok = started_late and swarm.peers["late"].process.returncode == 0
    loaded = joiner_loaded_step(folder / "late" / "peer.log") if started_late else None
    if late_ok and loaded is not None:
        alive = "from the running swarm" if trainers_alive_when_loaded == [True] else "after the trainers left"
        late_steps = json.loads((folder / "late" / "summary.json").read_text())["global_steps"]
        row["late_joiner"] = f"loaded step {loaded} {alive}, trained to step {late_steps}"
        row["late_joiner_step"] = late_steps
        row["late_joiner_max_abs_diff"] = compare_late_joiner(folder)
        if trainers_alive_when_loaded != [True]:
            problems.append("the late joiner loaded the state after the trainers left")
        if late_steps <= loaded:
            problems.append("the late joiner took no step with the swarm")
    elif started_late:
        row["late_joiner"] = "failed: " + swarm.peers["late"].log_tail(2).replace("\n", " | ")
        problems.append("late joiner failed")
    if row["export_reloaded"] != "yes":
        problems.append("export not reloaded")
    row["status"] = "; ".join(problems) or "ok"


def fill_checkpoint_columns(rehearsal, config, row: dict, path: Path, checkpoint: dict, export_dir: Path) -> None:
    row["checkpoint_mb"] = round(path.stat().st_size / 2**20, 1)
    row["state_download_mb_fp16"] = round(state_download_mb(checkpoint), 1)
    row["batchnorm_trained"] = batchnorm_trained(config, checkpoint)
    try:
        difference = check_export(rehearsal, config, export_dir, checkpoint)
        row["export_reloaded"] = "yes"
        row["export_max_abs_diff"] = f"{difference:.3g}"
    except Exception as error:  # any failure to reload is what this column reports
        row["export_reloaded"] = f"no: {type(error).__name__}: {error}"[:200]


def worker_processes(pid: int) -> List[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=False)
    except psutil.Error:
        return []


def run_ddp(rehearsal: Rehearsal, overrides: List[str], folder: Path, timeout: float, row: dict) -> None:
    config_path = str(ROOT / rehearsal.config)
    run_overrides = [*overrides, f"training.output_dir={folder / 'run'}"]
    peak, total_peak = 0.0, 0.0
    for attempt in ("train", "resume"):
        # the resumed run takes one step more than the checkpoint it resumes from: it trains on, not only loads
        extra = [f"training.max_global_steps={row['steps_target'] + 1}"] if attempt == "resume" else []
        command = [*torchrun_command(2, config_path), *run_overrides, *extra]
        log = (folder / f"{attempt}.log").open("wb")
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        started = time.monotonic()
        try:
            while process.poll() is None:
                if time.monotonic() - started > timeout:
                    raise TimeoutError(f"torchrun ({attempt}) ran past {timeout:.0f} s")
                # torchrun starts each worker in a session of its own: found as its children, not its group
                peak = max([peak, *(peak_rss_mb(worker.pid) or 0.0 for worker in worker_processes(process.pid))])
                total_peak = max(total_peak, group_pss_mb(process.pid))
                time.sleep(1)
        finally:
            if process.poll() is None:
                workers = worker_processes(process.pid)
                os.killpg(process.pid, signal.SIGTERM)  # torchrun passes it on to its workers
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                for worker in workers:  # in sessions of their own: torchrun's group does not reach them
                    with contextlib.suppress(psutil.Error):
                        worker.kill()
        if process.returncode != 0:
            row["status"] = f"torchrun ({attempt}) exit {process.returncode}: see {folder / f'{attempt}.log'}"
            return
        if attempt == "train":
            first_checkpoints = list_checkpoints(folder / "run" / CHECKPOINT_DIR)
    row["trainer_peak_rss_mb"] = round(peak)
    row["monitor_peak_rss_mb"] = "none (DDP)"
    row["run_peak_pss_mb"] = round(total_peak)
    resume_log = (folder / "resume.log").read_text(errors="replace").splitlines()
    resumed = [line for line in resume_log if "resumed from" in line]
    workers = sorted((folder / "run").glob("*/steps.jsonl"))
    steps = [json.loads(line) for line in workers[0].read_text().splitlines()] if workers else []
    row["steps"] = max((step["step"] + 1 for step in steps), default=0)
    row["s_per_step"] = round(sum(step["seconds"] for step in steps) / max(len(steps), 1), 1)
    row["late_joiner"] = (
        f"resumed at step {resumed[0].split('global step ')[-1].strip()}, then trained to step {row['steps']}"
        if resumed
        else "did not resume"
    )
    row["late_joiner_step"] = row["steps"] if resumed else ""
    # the export and its check use the first run's last checkpoint (the one the resumed run started from)
    checkpoints = first_checkpoints
    if not checkpoints:
        row["status"] = "no checkpoint"
        return
    export_dir = folder / "export"
    result = subprocess.run(
        [PYTHON, "scripts/export_model.py", "--config", config_path, "--checkpoint", str(checkpoints[-1])]
        + ["--output", str(export_dir), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    checkpoint = read_state_file(checkpoints[-1])
    config = load_config(config_path, overrides)
    fill_checkpoint_columns(rehearsal, config, row, checkpoints[-1], checkpoint, export_dir)
    if result.returncode != 0:
        row["export_reloaded"] = f"no: export exit {result.returncode}: {result.stderr.strip()[-150:]}"
    row["late_joiner_max_abs_diff"] = "n/a (DDP resumes from its checkpoint)"
    row["checkpoint_step"] = checkpoint_step(checkpoints[-1])
    ok = resumed and row["steps"] > row["steps_target"] and row["export_reloaded"] == "yes"
    row["status"] = "ok" if ok else "incomplete"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=CONFIG_KEYS_HELP,
    )
    parser.add_argument(
        "--configs", nargs="*", default=["swav_resnet50", "albert_large", "albert_large_ddp", "sahajbert"]
    )
    parser.add_argument("--steps", type=int, default=2, help="global steps of each rehearsal")
    parser.add_argument("--output", default="paper_results/fullscale", help="folder of rehearsal.csv/json")
    parser.add_argument("--runs", default="outputs/rehearsal", help="peer folders, logs, checkpoints")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each swarm may take")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    output, runs = Path(args.output), Path(args.runs).resolve()
    output.mkdir(parents=True, exist_ok=True)
    all_rehearsals = rehearsals(runs / "data")
    unknown = [name for name in args.configs if name not in all_rehearsals]
    if unknown:
        sys.stderr.write(f"error: unknown rehearsal {unknown[0]!r} (choose from {', '.join(all_rehearsals)})\n")
        sys.exit(2)
    write_fashion_mnist_pngs(runs / "data" / "fashion_mnist_png", PNG_IMAGES)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    facts = {
        "command": shlex.join([sys.executable.split("/")[-1], *sys.argv]),
        "machine": f"{platform.machine()} CPU container, {os.cpu_count()} cores, no GPU (shared with other work)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit.stdout.strip(),
        "rows": [],
    }
    csv_path, json_path = output / "rehearsal.csv", output / "rehearsal.json"
    previous = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    rows = {row["config"]: row for row in previous.get("rows", [])}
    for name in args.configs:
        rehearsal = all_rehearsals[name]
        overrides = [override.format(steps=args.steps) for override in rehearsal.overrides]
        folder = runs / name
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.mkdir(parents=True)
        row = {column: "" for column in COLUMNS}
        row.update(config=rehearsal.config, model=rehearsal.model, inputs=rehearsal.inputs, steps_target=args.steps)
        row["peers"] = (
            "2 DDP workers"
            if rehearsal.ddp
            else "monitor + 2 trainers"
            + (" (trainer0 and joiner in client mode) + aux" if rehearsal.auxiliary else "")
        )
        started, load_before = time.monotonic(), load_average()
        logger.info(f"{name}: preparing data")
        try:
            prep_overrides = [override for override in overrides if not override.startswith("training.max_global")]
            seconds, rss = prepare_data(rehearsal, prep_overrides, folder / "data_prep.log")
            row["data_prep_s"], row["data_prep_peak_pss_mb"] = round(seconds, 1), round(rss)
            built = "documents" in (folder / "data_prep.log").read_text()  # logged when the corpus is read
            if rehearsal.config.startswith("configs/albert") and not built:
                row["data_prep_s"] = f"{row['data_prep_s']} (cached)"  # tokenizer and examples were already built
            logger.info(f"{name}: rehearsing ({' '.join(overrides)})")
            (run_ddp if rehearsal.ddp else run_swarm)(rehearsal, overrides, folder, args.timeout, row)
        except Exception as error:  # a failed rehearsal is a row that says so; the others still run
            logger.exception(f"{name} failed")
            row["status"] = f"failed: {type(error).__name__}: {error}"[:300]
        row["wall_s"] = round(time.monotonic() - started)
        row["load_average_before_after"] = [load_before, load_average()]
        row.pop("steps_target", None)
        row["overrides"] = " ".join(overrides)
        row.update(machine=facts["machine"], date=facts["date"], commit=facts["commit"], command=facts["command"])
        rows[rehearsal.config] = row
        logger.info(f"{name}: {row}")
        facts["rows"] = list(rows.values())
        json_path.write_text(json.dumps(facts, indent=2) + "\n")
        with csv_path.open("w", newline="") as stream:
            fields = [*COLUMNS, "overrides", "machine", "date", "commit", "command"]
            writer = csv.DictWriter(stream, fieldnames=fields, extrasaction="ignore")  # notes stay in the JSON
            writer.writeheader()
            writer.writerows(rows.values())


if __name__ == "__main__":
    main()
