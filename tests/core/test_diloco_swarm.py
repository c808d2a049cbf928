"""Two diloco trainers in their own processes take an outer step together: both leave it with the same parameters,
the ones DiLoCo's update predicts from what each had before it; a third peer joining afterwards downloads the outer
parameters and the outer optimizer's momentum.

Run as a script, this module is one peer (``trainer`` or ``joiner``); the test starts them and reads what they wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hivemind.averaging.control import AveragingStage

from tests.helpers import FP16_TOLERANCE, PYTHON, ROOT, TINY_ALBERT, assert_no_processes_left, run_script

INNER_STEPS, OUTER_LR, OUTER_MOMENTUM = 2, 0.7, 0.9
DIRECTION = [1.0, -1.0, 0.5, 2.0]  # trainer i's gradient is (i + 1) x this at every inner step


class FourWeightTask:
    """Four weights stepped by plain SGD (lr 0.1): a trainer's inner steps add up exactly in its weights."""

    def __init__(self):
        self.model = torch.nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()

    def make_optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def make_scheduler(self, optimizer):
        return None

    def optimizer_param_groups(self):
        return [{"params": list(self.model.parameters())}]


def run_peer(role: str, index: int, folder: Path) -> None:
    import hivemind

    from common.config import CollaborationConfig, Compression, Semantics
    from common.hivemind_compat import install
    from common.optimizer import make_collaborative_optimizer, outer_momentum_tensors

    install()
    address_file = folder / "address.txt"
    initial_peers = address_file.read_text().split() if address_file.exists() else []
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers, start=True)
    if not initial_peers:
        address_file.write_text(" ".join(str(address) for address in dht.get_visible_maddrs()))
    task = FourWeightTask()
    collab = CollaborationConfig(
        run_id="diloco_swarm_test",
        semantics=Semantics.diloco,
        inner_steps=INNER_STEPS,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        target_batch_size=16,
        compression=Compression.none,  # exact arithmetic on the wire: the test compares to 1e-5
        matchmaking_time=2.0,
        averaging_timeout=30.0,
    )
    optimizer = make_collaborative_optimizer(dht, task, collab, local_batch_size=4)
    weight = task.model.weight
    report = folder / f"{role}{index}.json"
    try:
        if role == "joiner":
            optimizer.load_state_from_peers()
            report.write_text(
                json.dumps(
                    {
                        "epoch": optimizer.local_epoch,
                        "weight": weight.detach().flatten().tolist(),
                        "outer": optimizer.outer_parameters[0].flatten().tolist(),
                        "momentum": outer_momentum_tensors(optimizer.outer_optimizer)[0].flatten().tolist(),
                    }
                )
            )
            return
        before = {}
        take_outer_step = optimizer._outer_step

        def recorded_outer_step(next_epoch: int) -> None:
            before["local"] = weight.detach().flatten().tolist()
            before["outer"] = optimizer.outer_parameters[0].flatten().tolist()
            take_outer_step(next_epoch)

        optimizer._outer_step = recorded_outer_step
        outer_steps_wanted = 1
        if role == "apart":  # both trainers' first round fails, so each takes its first outer step alone
            outer_steps_wanted, round_of = 2, optimizer.outer_averager.step
            failed = []

            def first_round_fails(**kwargs):
                if not failed:
                    failed.append(optimizer.outer_parameters[0].flatten().tolist())
                    raise TimeoutError("the test's failed round")
                return round_of(**kwargs)

            optimizer.outer_averager.step = first_round_fails
        if role == "survivor":
            outer_steps_wanted = 2
        if role == "crasher":  # dies inside its first outer round, once its group is assembled and waits for it
            round_of = optimizer.outer_averager.step

            def crash_inside_the_round(**kwargs):
                control = round_of(**kwargs, wait=False, require_trigger=True)
                while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                    time.sleep(0.01)
                time.sleep(1.0)  # the others have the group too and send this peer their parts, which it never reduces
                os.killpg(os.getpgid(0), signal.SIGKILL)  # with its DHT, averagers and p2pd

            optimizer.outer_averager.step = crash_inside_the_round
        trainers = 3 if role in ("survivor", "crasher") else 2
        (folder / f"ready{index}").touch()
        while not all((folder / f"ready{other}").exists() for other in range(trainers)):  # none trains alone
            time.sleep(0.1)
        gradient = torch.tensor([DIRECTION]) * (index + 1)
        weight.grad = gradient.clone()
        optimizer.step(batch_size=4)  # 4 samples each of the first global step's 16
        deadline = time.monotonic() + 120
        # A trainer takes the outer step with the peers its progress tracker has seen: one that has not seen the
        # others by then steps alone. On a busy machine that can take longer than the two global steps do.
        while optimizer.tracker.global_progress.num_peers < trainers:
            assert time.monotonic() < deadline, "the trainers' progress trackers never saw each other"
            time.sleep(0.1)
        apart_after_first = None
        while optimizer.outer_steps < outer_steps_wanted and time.monotonic() < deadline:
            weight.grad = gradient.clone()
            optimizer.step(batch_size=4)
            if optimizer.outer_steps == 1 and apart_after_first is None:
                apart_after_first = optimizer.outer_parameters[0].flatten().tolist()
            time.sleep(0.3)
        report.write_text(
            json.dumps(
                {
                    **before,
                    "after_first": apart_after_first,
                    "outer_steps": optimizer.outer_steps,
                    "epoch": optimizer.local_epoch,
                    "after": weight.detach().flatten().tolist(),
                    "momentum": outer_momentum_tensors(optimizer.outer_optimizer)[0].flatten().tolist(),
                }
            )
        )
        while not (folder / "stop").exists():  # serve the state to the joiner
            time.sleep(0.2)
    finally:
        optimizer.shutdown()
        dht.shutdown()


def start(role: str, index: int, folder: Path) -> subprocess.Popen:
    log = (folder / f"{role}{index}.log").open("wb")
    return subprocess.Popen(
        [PYTHON, "-m", "tests.core.test_diloco_swarm", role, str(index), str(folder)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def wait_for(path: Path, processes, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was never written"
        assert all(process.poll() is None for process in processes), f"a peer exited early: see {path.parent}"
        time.sleep(0.5)
    time.sleep(0.2)  # written in one call; let it land
    return json.loads(path.read_text())


def start_peers(roles, folder: Path, processes: list) -> None:
    """The first peer, then (once it wrote its address) the others, each added to ``processes`` as it starts (the
    caller stops them whatever happens); ``roles``: (role, index) pairs."""
    processes.append(start(*roles[0], folder))
    deadline = time.monotonic() + 60
    while not (folder / "address.txt").exists():
        assert time.monotonic() < deadline and processes[0].poll() is None, "the first trainer did not start"
        time.sleep(0.2)
    processes.extend(start(role, index, folder) for role, index in roles[1:])


def stop_peers(processes, folder: Path) -> None:
    (folder / "stop").touch()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever of its group is left (its DHT, averagers, p2pd), also after the peer itself exited
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_trainers_leave_an_outer_step_equal_and_a_joiner_loads_the_outer_state(tmp_path):
    processes = []
    try:
        start_peers([("trainer", 0), ("trainer", 1)], tmp_path, processes)
        trainers = [wait_for(tmp_path / f"trainer{index}.json", processes, 180) for index in range(2)]
        assert all(trainer["epoch"] == INNER_STEPS for trainer in trainers), trainers

        outer = torch.tensor(trainers[0]["outer"])
        pseudo_gradient = torch.stack([outer - torch.tensor(trainer["local"]) for trainer in trainers]).mean(0)
        momentum = pseudo_gradient  # the first outer step: zero momentum times 0.9 plus the gradient
        expected = outer - OUTER_LR * (pseudo_gradient + OUTER_MOMENTUM * momentum)
        for trainer in trainers:
            assert torch.allclose(torch.tensor(trainer["outer"]), outer)  # they started the round together
            assert torch.allclose(torch.tensor(trainer["after"]), expected, atol=1e-5), (trainer, expected)
            assert torch.allclose(torch.tensor(trainer["momentum"]), momentum, atol=1e-5)
        assert trainers[0]["after"] == trainers[1]["after"]
        assert trainers[0]["local"] != trainers[1]["local"]  # they did drift apart in between

        processes.append(start("joiner", 0, tmp_path))
        joiner = wait_for(tmp_path / "joiner0.json", processes[2:], 120)
        assert joiner["epoch"] == INNER_STEPS
        assert torch.allclose(torch.tensor(joiner["weight"]), expected, atol=1e-5)
        assert joiner["outer"] == joiner["weight"]
        assert torch.allclose(torch.tensor(joiner["momentum"]), momentum, atol=1e-5)
    finally:
        stop_peers(processes, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainers_that_stepped_apart_realign_their_outer_state_at_the_next_round(tmp_path):
    """Both trainers' first round fails, so each applies its own pseudo-gradient: their outer parameters differ,
    and averaging pseudo-gradients alone would keep them apart. The next round finds their lineages differ; they
    average their outer state and leave it equal."""
    processes = []
    try:
        start_peers([("apart", 0), ("apart", 1)], tmp_path, processes)
        trainers = [wait_for(tmp_path / f"apart{index}.json", processes, 240) for index in range(2)]
        assert all(trainer["outer_steps"] == 2 for trainer in trainers), trainers
        assert torch.allclose(torch.tensor(trainers[0]["after"]), torch.tensor(trainers[1]["after"]), atol=1e-6)
        assert torch.allclose(torch.tensor(trainers[0]["momentum"]), torch.tensor(trainers[1]["momentum"]), atol=1e-6)
        for index in range(2):
            log = (tmp_path / f"apart{index}.log").read_text()
            # each stepped alone first (its own pseudo-gradient: equal outer parameters only by coincidence)
            assert "before global step 2 used this peer's pseudo-gradient only" in log, log[-3000:]
            assert "realigned with 1 other peer(s)" in log, log[-3000:]
    finally:
        stop_peers(processes, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_of_a_crash_inside_an_outer_round_realign_at_the_next_one(tmp_path):
    """Three trainers; the third is SIGKILLed (with its DHT, averagers and p2pd) inside its first outer round, once
    its group is assembled. hivemind ends the round for the other two with the crashed member's part of the vector
    left at each one's own values, so they leave it different. They find that out from the round (partial) and
    realign their outer state at the next outer round, which they leave equal. (Should the crash come before the
    round began on the others' side, they average without it and are equal all along.)"""
    processes = []
    try:
        start_peers([("survivor", 0), ("survivor", 1), ("crasher", 2)], tmp_path, processes)
        survivors = [wait_for(tmp_path / f"survivor{index}.json", processes[:2], 240) for index in range(2)]
        assert processes[2].wait(timeout=30) == -signal.SIGKILL
        assert all(survivor["outer_steps"] == 2 for survivor in survivors), survivors
        assert torch.allclose(torch.tensor(survivors[0]["after"]), torch.tensor(survivors[1]["after"]), atol=1e-6)
        assert torch.allclose(
            torch.tensor(survivors[0]["momentum"]), torch.tensor(survivors[1]["momentum"]), atol=1e-6
        )
        logs = [(tmp_path / f"survivor{index}.log").read_text() for index in range(2)]
        # hivemind's line for a partial round; without one the crash came before the round began (no difference)
        if any("Averaging: received" in log for log in logs):
            assert any("a member of the round failed" in log for log in logs)
            for log in logs:
                assert "realigned with 1 other peer(s)" in log, log[-3000:]
        else:
            assert survivors[0]["after_first"] == survivors[1]["after_first"]
    finally:
        stop_peers(processes, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_diloco_swarm_of_the_scripts_checkpoints_the_outer_state_and_ends_agreed(tmp_path, tiny_overrides):
    """scripts/local_swarm.py with a monitor, 2 trainers and an auxiliary peer under diloco (H=2, 4 global steps):
    the monitor's checkpoint holds the outer momentum and its export, and the trainers end on the same outer step."""
    run_dir = tmp_path / "run"
    result = run_script(
        "scripts/local_swarm.py",
        "--config",
        TINY_ALBERT,
        "--trainers",
        "2",
        "--aux",
        "1",
        "--output",
        str(run_dir),
        "--timeout",
        "420",
        *tiny_overrides,
        "collaboration.semantics=diloco",
        "collaboration.inner_steps=2",
        "training.max_global_steps=4",
        "collaboration.target_batch_size=64",
        "training.local_batch_size=16",
        "collaboration.expected_peers=2",
        "monitor.checkpoint_every_steps=2",
        "collaboration.run_id=diloco_scripts_test",
        timeout=500,
    )
    try:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        checkpoints = sorted((run_dir / "monitor" / "checkpoints").glob("step_*.pt"))
        assert checkpoints, "the monitor saved no checkpoint"
        state = torch.load(checkpoints[-1], map_location="cpu", weights_only=False)
        momentum = [entry["momentum_buffer"] for entry in state["outer_optimizer"]["state"].values()]
        assert momentum and any(float(buffer.abs().sum()) > 0 for buffer in momentum)  # an outer step was taken
        assert (run_dir / "monitor" / "hf_model" / "config.json").is_file()
        finals = [torch.load(run_dir / f"trainer{index}" / "final_model.pt") for index in range(2)]
        difference = max(float((finals[0][key] - finals[1][key]).abs().max()) for key in finals[0])
        assert difference <= FP16_TOLERANCE  # fp16 on the wire leaves each peer its own share in full precision
        for index in range(2):
            log = (run_dir / f"trainer{index}" / "peer.log").read_text()
            assert re.search(r"outer step before global step 4: pseudo-gradient averaged with [1-9]", log), log[-2000:]
            assert "Traceback" not in log
    finally:
        assert_no_processes_left(run_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one peer of the diloco swarm test")
    parser.add_argument("role", choices=["trainer", "apart", "survivor", "crasher", "joiner"])
    parser.add_argument("index", type=int)
    parser.add_argument("folder", type=Path)
    arguments = parser.parse_args()
    sys.exit(run_peer(arguments.role, arguments.index, arguments.folder))
