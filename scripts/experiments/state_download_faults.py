"""State downloads under faults: donors killed, frozen or corrupting mid-transfer while newcomers download at once.

Each trial starts donor peers (one OS process each, with its DHT, p2p daemon and averager process) that all serve
the same known state (parameters of the tiny ALBERT's largest shapes and AdamW statistics, filled from one seed,
at global step 7) through hivemind's state download, and newcomers that download it concurrently, as a joining
trainer or the monitor does (``TrainingStateAverager.load_state_from_peers``). Every donor but one misbehaves once
a request has streamed ``--after-parts`` parts (each part is slowed by ``--part-delay`` so transfers overlap):

* ``kill-averager``: its averager process (which serves the stream) is killed (SIGKILL);
* ``kill-peer``: its whole process group is killed (DHT, p2p daemon, averager);
* ``freeze``: its whole process group is stopped (SIGSTOP) until the trial ends;
* ``corrupt``: one byte of that part is flipped: a tensor of the right size with wrong bytes;
* ``no-digest``: it serves its state as hivemind does, without digests (a peer of another protocol).

Newcomers ask the donors with the highest ``state_sharing_priority`` first; the faulty donors get the highest (in a
random order per trial), the good donor the lowest, so every newcomer meets every fault before the good state.
Each newcomer then compares what it loaded with the known state, bit for bit: ``exact`` (the known state at step
7), ``nothing`` (no state loaded), ``corrupt`` (loaded, or changed, but not the known state). With ``--protocol
hivemind`` every peer runs hivemind 1.1.12 as it is (no end-of-stream marker, no digests): the reproduction.

    python scripts/experiments/state_download_faults.py --trials 10 --out paper_results/state_download/faults.json
    python scripts/experiments/state_download_faults.py --trials 3 --protocol hivemind \
        --out paper_results/state_download/faults_hivemind.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common.errors import UserError, exit_on_user_error

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "state_download_faults_state_averager"
SERVED_EPOCH = 7
DONOR_SEED, NEWCOMER_SEED = 1, 2
FAULTS = ("kill-averager", "kill-peer", "freeze", "corrupt", "no-digest")
logger = logging.getLogger("state_download_faults")


# ---------------------------------------------------------------------------------------------------------- peers


def build_state_averager(dht, seed: int, **options):
    """A state averager as the monitor builds one, on a small model with the tiny ALBERT's largest shapes (its word
    embeddings [4000, 64] and feed-forward [128, 512]) and AdamW statistics, all filled from ``seed``."""
    from hivemind.optim.state_averager import TrainingStateAverager

    averager = TrainingStateAverager(
        dht=dht,
        optimizer=make_optimizer,
        params=make_model().parameters(),
        prefix=PREFIX,
        initialize_optimizer=False,
        start=True,
        **options,
    )
    fill_state(averager.optimizer, seed)
    return averager


def make_model():
    import torch

    return torch.nn.Sequential(torch.nn.Embedding(4000, 64), torch.nn.Linear(64, 128), torch.nn.Linear(128, 512))


def make_optimizer(params):
    import torch

    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param].update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param)
            )
    return optimizer


def fill_state(optimizer, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in state_tensors(optimizer):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator).abs())


def state_tensors(optimizer) -> list:
    """Parameters, then every tensor of the optimizer's state, in a fixed order."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    statistics = [
        optimizer.state[param][name]
        for param in params
        for name in sorted(optimizer.state[param])
        if hasattr(optimizer.state[param][name], "shape")
    ]
    return [param.data for param in params] + statistics


def start_peer_dht(initial_peers, protocol: str):
    import hivemind

    if protocol == "ours":
        from common.config import NetworkConfig
        from common.dht import start_dht

        network = NetworkConfig(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        return start_dht(network)
    return hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)


def install_fault(fault: str, after_parts: int, part_delay: float) -> None:
    """Make this donor's ``rpc_download_state`` misbehave after ``after_parts`` parts (in its averager process)."""
    from hivemind.optim.state_averager import TrainingStateAverager

    serve = TrainingStateAverager.rpc_download_state
    if fault == "no-digest":  # hivemind's own serving thread: the state goes out without digests
        from hivemind.averaging import averager as averager_module

        averager_module._background_thread_fetch_current_state = ORIGINAL_FETCH

    @functools.wraps(serve)
    async def rpc_download_state(self, _request, _context):
        sent = 0
        async for message in serve(self, _request, _context):
            await asyncio.sleep(part_delay)
            if fault == "corrupt" and sent == after_parts:
                buffer = bytearray(message.tensor_part.buffer)
                buffer[len(buffer) // 2] ^= 0x40
                message.tensor_part.buffer = bytes(buffer)
            yield message
            sent += 1
            if sent == after_parts:
                if fault == "kill-averager":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif fault == "kill-peer":
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                elif fault == "freeze":
                    os.killpg(os.getpgid(0), signal.SIGSTOP)

    TrainingStateAverager.rpc_download_state = rpc_download_state


ORIGINAL_FETCH = None


def run_donor(args) -> None:
    global ORIGINAL_FETCH
    from hivemind.averaging import averager as averager_module

    ORIGINAL_FETCH = averager_module._background_thread_fetch_current_state
    dht = start_peer_dht(args.initial_peers, args.protocol)
    install_fault(args.fault, args.after_parts, args.part_delay)
    averager = build_state_averager(dht, DONOR_SEED)
    averager.local_epoch = SERVED_EPOCH
    averager.state_sharing_priority = args.priority
    address = [str(maddr) for maddr in dht.get_visible_maddrs()][0]
    sys.stdout.write(f"READY {address}\n")
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(1)


def run_newcomer(args) -> None:
    import torch

    dht = start_peer_dht(args.initial_peers, args.protocol)
    key = f"{PREFIX}.all_averagers"
    deadline = time.monotonic() + 60
    while True:  # start barrier: every donor has declared its state
        entry = dht.get(key, latest=True)
        declared = len(entry.value) if entry is not None and isinstance(entry.value, dict) else 0
        if declared >= args.donors or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    averager = build_state_averager(dht, NEWCOMER_SEED, allow_state_sharing=False)
    before = [tensor.clone() for tensor in state_tensors(averager.optimizer)]
    expected = build_expected_state()
    started = time.monotonic()
    attempts, error = 0, None
    while attempts < args.attempts and averager.local_epoch != SERVED_EPOCH:
        attempts += 1
        try:
            averager.load_state_from_peers(timeout=args.load_timeout)
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
    elapsed = time.monotonic() - started
    after = state_tensors(averager.optimizer)
    exact = len(after) == len(expected) and all(torch.equal(a, b) for a, b in zip(after, expected))
    unchanged = all(torch.equal(a, b) for a, b in zip(after, before))
    if averager.local_epoch == SERVED_EPOCH and exact:
        outcome = "exact"
    elif averager.local_epoch != SERVED_EPOCH and unchanged:
        outcome = "nothing"
    else:
        outcome = "corrupt"
    result = dict(outcome=outcome, epoch=averager.local_epoch, attempts=attempts, seconds=round(elapsed, 2))
    result.update(error=error)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    averager.shutdown()
    dht.shutdown()


def build_expected_state() -> list:
    """The known state, built without hivemind: the optimizer filled from the donors' seed."""
    optimizer = make_optimizer(make_model().parameters())
    fill_state(optimizer, DONOR_SEED)
    return [tensor.clone() for tensor in state_tensors(optimizer)]


# ---------------------------------------------------------------------------------------------------------- driver


def _start(role_args, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, __file__, *role_args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
            env=env,
            cwd=ROOT,
        )
    process.log_path = log_path
    return process


def _read_line(process: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The first stdout line starting with ``prefix`` (the process is killed by the caller on failure)."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if selector.select(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                line = process.stdout.readline()
                if not line:
                    break
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            elif process.poll() is not None:
                break
    finally:
        selector.close()
    tail = " | ".join(process.log_path.read_text(errors="replace").strip().splitlines()[-3:])
    raise RuntimeError(f"process {process.pid} gave no {prefix.strip()} line within {timeout:.0f} s (log: {tail})")


def _stop(processes) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGCONT)  # a frozen group must wake to die cleanly of SIGKILL too
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning(f"process {process.pid} did not exit")
    deadline = time.monotonic() + 30
    for process in processes:  # the rest of each group (DHT, averager, p2p daemon) until it is reaped
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            logger.warning(f"the processes of group {process.pid} did not exit")


def run_trial(index: int, args, workdir: Path) -> dict:
    rng = random.Random(args.seed * 1000 + index)
    faults = list(args.faults)
    rng.shuffle(faults)
    after_parts = rng.randint(2, args.max_after_parts)
    common_args = ["--protocol", args.protocol, "--part-delay", str(args.part_delay)]
    processes = []
    started = time.monotonic()
    try:
        good = _start(["_donor", "--fault", "none", "--priority", "1", *common_args], workdir / f"t{index}_good.log")
        processes.append(good)
        address = _read_line(good, "READY ", args.start_timeout)
        donors = []
        for rank, fault in enumerate(faults):
            priority = str(len(faults) + 1 - rank)
            role_args = ["_donor", "--fault", fault, "--priority", priority, "--after-parts", str(after_parts)]
            donor = _start([*role_args, "--initial-peers", address, *common_args], workdir / f"t{index}_{fault}.log")
            processes.append(donor)
            donors.append(donor)
        for donor in donors:
            _read_line(donor, "READY ", args.start_timeout)
        newcomers = []
        for number in range(args.newcomers):
            role_args = ["_newcomer", "--donors", str(len(faults) + 1), "--initial-peers", address, *common_args]
            role_args += ["--load-timeout", str(args.load_timeout), "--attempts", str(args.attempts)]
            newcomer = _start(role_args, workdir / f"t{index}_newcomer{number}.log")
            processes.append(newcomer)
            newcomers.append(newcomer)
        results = []
        for newcomer in newcomers:
            try:
                result = json.loads(_read_line(newcomer, "RESULT ", args.newcomer_timeout))
            except RuntimeError as error:
                result = dict(outcome="no result", error=str(error))
            result["log"] = warning_lines(newcomer.log_path)
            results.append(result)
    finally:
        _stop(processes)
    trial = dict(trial=index, order=faults, after_parts=after_parts, seconds=round(time.monotonic() - started, 1))
    trial["newcomers"] = results
    return trial


def warning_lines(log_path: Path) -> list:
    """The newcomer's WARNING and ERROR lines (its averager process logs the downloads), first line of each."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line[:400] for line in lines if "[WARN]" in line or "[ERROR]" in line]


def summarize(trials) -> dict:
    outcomes = [newcomer["outcome"] for trial in trials for newcomer in trial["newcomers"]]
    warnings = [line for trial in trials for newcomer in trial["newcomers"] for line in newcomer["log"]]
    kinds = {
        "digest mismatch": "does not match its digest",
        "no digests": "came without digests",
        "stream cut short": "ended before its end marker",
        "tensor of the wrong size (hivemind)": "is invalid for input of size",
    }
    return dict(
        trials=len(trials),
        trials_not_run=sum("not_run" in trial for trial in trials),
        downloads=len(outcomes),
        outcomes={outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))},
        refusals={kind: sum(text in line for line in warnings) for kind, text in kinds.items()},
    )


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="role")
    for role in ("_donor", "_newcomer"):
        peer = sub.add_parser(role)
        peer.add_argument("--protocol", choices=("ours", "hivemind"), default="ours")
        peer.add_argument("--initial-peers", nargs="*", default=[])
        peer.add_argument("--part-delay", type=float, default=0.005)
        if role == "_donor":
            peer.add_argument("--fault", choices=("none", *FAULTS), required=True)
            peer.add_argument("--priority", type=float, required=True)
            peer.add_argument("--after-parts", type=int, default=0)
        else:
            peer.add_argument("--donors", type=int, required=True)
            peer.add_argument("--load-timeout", type=float, default=60)
            peer.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--newcomers", type=int, default=3)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--protocol", choices=("ours", "hivemind"), default="ours")
    parser.add_argument("--part-delay", type=float, default=0.005, help="seconds each donor waits before each part")
    parser.add_argument("--max-after-parts", type=int, default=60, help="a fault strikes after 2..N parts")
    parser.add_argument("--load-timeout", type=float, default=60)
    parser.add_argument("--attempts", type=int, default=3, help="download attempts per newcomer")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for a donor to start serving")
    parser.add_argument("--newcomer-timeout", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="keep every peer's log here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="JSON artefact (every trial, the command, machine and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.role == "_donor":
        return run_donor(args)
    if args.role == "_newcomer":
        return run_newcomer(args)
    if args.trials < 1 or args.newcomers < 1:
        raise UserError("--trials and --newcomers must be at least 1")
    trials = []
    with tempfile.TemporaryDirectory(prefix="state_download_faults_") as workdir:
        workdir = args.log_dir or workdir
        Path(workdir).mkdir(parents=True, exist_ok=True)
        for index in range(args.trials):
            try:
                trial = run_trial(index, args, Path(workdir))
            except RuntimeError as error:  # a donor that did not start in time: no download was tried
                trial = dict(trial=index, not_run=str(error)[:300], newcomers=[])
                logger.warning(f"trial {index + 1}/{args.trials} not run: {error}")
            else:
                logger.info(
                    f"trial {index + 1}/{args.trials} ({trial['seconds']} s, faults in order {trial['order']}, "
                    f"after {trial['after_parts']} parts): "
                    + ", ".join(newcomer["outcome"] for newcomer in trial["newcomers"])
                )
            trials.append(trial)
            write_artefact(args, trials)  # after every trial, so that a stopped loop keeps what it ran
    logger.info(f"summary: {json.dumps(summarize(trials))}")


def write_artefact(args, trials) -> None:
    summary = summarize(trials)
    if args.out is not None:
        artefact = dict(
            command="python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
            machine=f"{platform.machine()} container, {os.cpu_count()} CPU cores, no GPU",
            date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            load_average_1min_at_end=round(os.getloadavg()[0], 1),
            protocol=args.protocol,
            summary=summary,
            trials=trials,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(artefact, indent=1) + "\n")


if __name__ == "__main__":
    main()
