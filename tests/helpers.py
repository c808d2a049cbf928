"""What the tests share: repository paths, running scripts (and torchrun) as a user would, JSONL logs, and a
single-process replay of exactly the micro-batches a distributed run logged."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TINY_ALBERT = str(ROOT / "configs/albert/tiny.yaml")

from common.backends import SingleProcessBackend  # noqa: E402  (conftest puts the repository on sys.path)
from common.config import RunConfig, load_config  # noqa: E402
from common.swarm import LocalSwarm  # noqa: E402
from common.task import Task  # noqa: E402
from common.tools.comparison import torchrun_command  # noqa: E402

# How far fp16 wire compression may leave trainers apart (2 x lr with LAMB; the reasoning is in tiny.yaml).
FP16_TOLERANCE = load_config(TINY_ALBERT).collaboration.agreement_tolerance


def run_script(*arguments: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a repository script as a user would, capturing its output."""
    return run_command([PYTHON, *arguments], timeout, env)


def run_command(command: List[str], timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root with this environment (plus ``env``), capturing its output."""
    return subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def run_ddp_training(*overrides: str, workers: int = 2, timeout: float = 360) -> subprocess.CompletedProcess:
    """The HPC baseline as a user launches it: torchrun with ``workers`` processes of scripts/train.py."""
    return run_command([*torchrun_command(workers, TINY_ALBERT), *overrides], timeout)


def run_trainers(config_path: str, run_dir: Path, overrides: List[str], trainers: List[str], timeout: float) -> None:
    """A swarm of ``trainers`` alone (the first starts it, the others join it), run to its end: every trainer must
    exit with code 0 within ``timeout`` seconds."""
    with LocalSwarm(config_path, run_dir, overrides) as swarm:
        swarm.start_first_peer("trainer", trainers[0])
        for name in trainers[1:]:
            swarm.start("trainer", name)
        assert swarm.wait(trainers, timeout=timeout), "trainers did not finish in time"
        assert all(swarm.peers[name].process.returncode == 0 for name in trainers), [
            swarm.peers[name].log_tail() for name in trainers
        ]


# Set by tests/conftest.py in each test process (one per pytest-xdist worker) and inherited by everything it starts:
# what a test leaves behind is told apart from the processes and namespaces of other tests running beside it.
TEST_SESSION_VARIABLE = "DEDLOC_TEST_SESSION"


def _started_by_this_session(pid: int) -> bool:
    if pid == os.getpid():  # its /proc environ is the one it was started with, before conftest set the variable
        return True
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False
    return f"{TEST_SESSION_VARIABLE}={os.environ[TEST_SESSION_VARIABLE]}".encode() in environment


def own_processes(pattern: str) -> List[str]:
    """``pgrep -af pattern`` lines of the processes this test session started (directly or not)."""
    listing = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listing if _started_by_this_session(int(line.split()[0]))]


def leftover_namespaces(before: set) -> set:
    """Network namespaces created since ``before`` whose owner (``common.tools.netns`` names each after the pid that
    built it) is gone or belongs to this session: those of other tests or benchmarks running beside it are theirs."""
    from common.tools.netns import NAMESPACE_PREFIX, list_namespaces

    leftover = set()
    for name in set(list_namespaces()) - before:
        owner = re.match(rf"{NAMESPACE_PREFIX}(\d+)-", name)
        if owner is None or not Path(f"/proc/{owner[1]}").exists() or _started_by_this_session(int(owner[1])):
            leftover.add(name)
    return leftover


def assert_no_processes_left(run_dir: Path) -> None:
    """No process (peer, DHT, p2pd) still mentions this run's folder."""
    listing = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    assert not listing.strip(), f"processes left behind:\n{listing}"


def read_jsonl(path: Path) -> List[dict]:
    """The records of a JSON-lines log (a step log, a monitor history); none if the file does not exist yet."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_step_logs(paths: List[Path]) -> List[dict]:
    return [record for path in paths for record in read_jsonl(path)]


def replay_single_process(config: RunConfig, records: List[dict], steps: int) -> Dict[str, torch.Tensor]:
    """Train ``steps`` global steps; step s uses the union of every worker's micro-batches logged for s.

    Under fp16 each micro-batch runs in the run's autocast and is backpropagated at the loss scale its peer logged
    for it, then unscaled at once. That is a peer's arithmetic: it unscales what it accumulated with its own scale
    before the peers average (hivemind.GradScaler), and powers of two scale exactly. (A GradScaler of the replay's
    own would backpropagate at 2^16 throughout: the replay never sees the overflow after which the peers halved
    theirs, and fp16 gradients near its smallest numbers round differently at another scale.)
    """
    threads = torch.get_num_threads()
    # the run's intra-op threads (a peer sets training.num_threads): CPU kernels split their sums by thread, and
    # under fp16 autocast every such sum is rounded to float16, so another thread count changes the gradients
    # (measured: 1.5e-3 apart after one LAMB update, fp16, 1 vs 2 threads; 0 at equal counts)
    torch.set_num_threads(config.training.num_threads)
    try:
        return _replay(config, records, steps)
    finally:
        torch.set_num_threads(threads)


def _replay(config: RunConfig, records: List[dict], steps: int) -> Dict[str, torch.Tensor]:
    from common.config import Semantics, import_task_module
    from common.context import RunContext

    cpu = torch.device("cpu")
    context = RunContext.resolve(config, cpu)
    precision = context.precision
    context.seed_parameters()
    task = import_task_module(config.task_module).build_task(config)
    # each step's micro-batches are applied at that step, unscaled below: a plain fp32 sync backend
    backend = SingleProcessBackend(task, dataclasses.replace(config.collaboration, semantics=Semantics.sync))
    for step in range(steps):
        micro_batches = [batch for record in records if record["step"] == step for batch in record["micro_batches"]]
        total = sum(len(batch["ids"]) for batch in micro_batches)
        # hivemind ends a step when its *estimate* of the swarm's samples reaches the target, so a step may hold a
        # little less (496 of 512 seen): the reference then steps on exactly those samples too
        assert total > 0, f"no micro-batch was logged for step {step}"
        backend.target_batch_size = total
        finished = None
        for micro_batch in micro_batches:
            with precision.autocast(cpu):
                output = task.forward(task.model, task.dataset.batch(micro_batch["ids"], micro_batch["pass"]))
            scale = micro_batch.get("loss_scale")
            assert (scale is not None) == (precision == "fp16"), "fp16 runs log every micro-batch's loss scale"
            if scale is None:
                output.loss.backward()
            else:
                (output.loss * scale).backward()
                for param in backend.params:
                    if param.grad is not None:
                        param.grad.div_(scale)
                        assert bool(torch.isfinite(param.grad).all()), f"the replay overflowed at step {step}"
            finished = backend.step(output.batch_size)
            backend.zero_grad()
        assert finished == step
    return task.model.state_dict()


def max_difference(first: Dict[str, torch.Tensor], second: Dict[str, torch.Tensor]) -> float:
    return max(float((first[key] - second[key]).abs().max()) for key in first if first[key].is_floating_point())


def differences_from_replay(
    config_path: str, run_dir: Path, overrides: List[str], trainers: List[str], steps: int
) -> List[float]:
    """How far each trainer's final parameters lie from one process replaying the micro-batches all of them logged
    (the run's config on the single-process backend), trainer by trainer."""
    records = read_step_logs([run_dir / name / "steps.jsonl" for name in trainers])
    reference = replay_single_process(
        load_config(config_path, [*overrides, "training.backend=single"]), records, steps
    )
    return [max_difference(torch.load(run_dir / name / "final_model.pt"), reference) for name in trainers]


# hivemind's fault-tolerance paths: a round that missed a peer or part of its results falls back to local values
DEGRADED_ROUND_MARKERS = (
    "Proceeding with local gradients",
    "Averaging gradients failed",
    "Averaging: received",
    "Skipping pre-scheduled averaging round",
    "used this peer's gradients only",
)


def degraded_rounds(peer_dirs) -> list:
    """The log lines in which a peer's averaging round fell back to local values, each with the peer's folder."""
    return [
        f"{peer_dir.name}: {line.strip()}"
        for peer_dir in peer_dirs
        for line in (peer_dir / "peer.log").read_text(errors="replace").splitlines()
        if any(marker in line for marker in DEGRADED_ROUND_MARKERS)
    ]


def network_emulation_unavailable() -> str | None:
    """Why emulated hosts cannot be built here (not root, no nftables, ...), or None when they can."""
    from common.tools.netns import NetworkEmulationUnavailable, check_available

    try:
        check_available(need_firewall=True)
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


def python_on_host(network, host: int, code: str, *arguments: str) -> List[str]:
    """The command that runs Python ``code`` (``sys.argv[1:]`` = ``arguments``) on host ``host`` of an
    ``EmulatedNetwork``."""
    return network.command_prefix(host) + [PYTHON, "-c", code, *arguments]


@contextlib.contextmanager
def running(command: List[str], **options):
    """``command`` started (``subprocess.Popen`` with ``options``) for the block, killed and reaped after it."""
    process = subprocess.Popen(command, **options)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def needs_network_namespaces(test):
    reason = network_emulation_unavailable()
    return pytest.mark.skipif(reason is not None, reason=f"network namespaces unavailable: {reason}")(test)


def small_albert_config():
    """An ALBERT small enough to build and train in seconds (unit tests of export and fine-tuning)."""
    from albert.task import TaskConfig

    return TaskConfig(
        vocab_size=600,
        embedding_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_seq_length=32,
    )


def swarm_overrides(base: List[str], steps: int, target_batch_size: int, expected_peers: int) -> List[str]:
    """``base``, then a collaborative run of ``steps`` global steps of ``target_batch_size`` samples that starts once
    ``expected_peers`` trainers report progress; the monitor keeps no checkpoints."""
    return [
        *base,
        f"training.max_global_steps={steps}",
        f"collaboration.target_batch_size={target_batch_size}",
        f"collaboration.expected_peers={expected_peers}",
        "monitor.checkpoint_every_steps=0",
    ]


# Settings under which one process replaying the micro-batches a run logged must reach its parameters.
REPLAYABLE_OVERRIDES = [
    "debug.record_sample_ids=true",
    "task.warmup_steps=1",
    # dropout draws from each process's own RNG; equivalence is about the optimisation, so no dropout
    "task.classifier_dropout_prob=0.0",
]
# ... and under which collaborative peers do (sync equivalence).
EQUIVALENCE_OVERRIDES = [
    *REPLAYABLE_OVERRIDES,
    "collaboration.expected_peers=2",
    "collaboration.compression=none",
    "collaboration.semantics=sync",
    "training.local_batch_size=16",
    # a peer still finishing its micro-batch when the round starts must not be dropped from it
    "collaboration.matchmaking_time=4.0",
    "collaboration.averaging_timeout=60",
    # nor one that starts its share of the all-reduce seconds after its groupmate (a loaded CPU): with hivemind's
    # default (matchmaking_time) a 10-s gap dropped both parts of a round
    "collaboration.next_chunk_timeout=30",
]


class OneWeightTask(Task):
    """A single weight stepped by plain SGD (lr 1), so each applied gradient shows up exactly in the weight."""

    def __init__(self):
        self.model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()

    def make_optimizer(self, params):
        return torch.optim.SGD(params, lr=1.0)

    def batches(self, stream_seed):
        raise NotImplementedError  # the tests hand the backend gradients directly

    def forward(self, model, batch):
        raise NotImplementedError
