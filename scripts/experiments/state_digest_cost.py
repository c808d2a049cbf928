"""What verifying state downloads costs: per-tensor digests of the served state (common.state_integrity).

``hash``: in one process, for the tiny ALBERT (configs/albert/tiny.yaml) and the paper-sized one (the ALBERT-large
shape of configs/albert/paper.yaml), each with its LAMB statistics, times what a donor adds once per served step
(snapshot + digests), what it adds per request (recognising an unchanged step), and what a receiver adds (checking
the digests), beside the serialization work every download does anyway (serialize, split into 64-KiB parts,
reassemble, deserialize).

``download``: real downloads of the tiny ALBERT's state between two peers (two OS processes over loopback), as a
joining trainer or the monitor makes them (``TrainingStateAverager.load_state_from_peers``), with the digests
(this project's protocol) and without them (the same peers with ``verify_state_downloads`` left out).

    python scripts/experiments/state_digest_cost.py hash --repeats 5 \
        --out paper_results/state_download/digest_cost.json
    python scripts/experiments/state_digest_cost.py download --downloads 10 \
        --out paper_results/state_download/download_time.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common.errors import exit_on_user_error

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"tiny": ROOT / "configs/albert/tiny.yaml", "paper": ROOT / "configs/albert/paper.yaml"}
PREFIX = "state_digest_cost_state_averager"
logger = logging.getLogger("state_digest_cost")


def build_model_and_optimizer(model: str):
    import torch

    from common.config import import_task_module, load_config

    config = load_config(MODELS[model])
    task = import_task_module(config.task_module).build_task(config, with_data=False)
    optimizer = task.make_optimizer(task.optimizer_param_groups())
    for group in optimizer.param_groups:  # one step on zero gradients creates LAMB's statistics, as hivemind does
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    return task, optimizer


def served_tensors(optimizer) -> list:
    """What a training state averager serves: its parameters, then its optimizer's state tensors."""
    from hivemind.optim.state_averager import dump_optimizer_state

    params = [param.detach() for group in optimizer.param_groups for param in group["params"]]
    return params + list(dump_optimizer_state(optimizer)[1])


def _median_time(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_hashing(model: str, repeats: int) -> dict:
    import torch
    from hivemind.compression import CompressionInfo, NoCompression, deserialize_torch_tensor
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    from common.state_integrity import served_state, state_problem, with_digests

    torch.manual_seed(0)
    _task, optimizer = build_model_and_optimizer(model)
    tensors = served_tensors(optimizer)
    compression = NoCompression()  # hivemind's default for state downloads (load_state_compression)
    metadata = dict(epoch=7)

    def serve(previous=None):
        return served_state(previous, b"metadata", metadata, tensors, None, compression)

    def transfer():
        assembled = []
        for index, tensor in enumerate(tensors):
            info = CompressionInfo.from_tensor(tensor, key=index)
            serialized = compression.compress(tensor, info, allow_inplace=False)
            assembled.append(combine_from_streaming(list(split_for_streaming(serialized))))
        return assembled

    served = serve()
    assembled = transfer()
    digested = with_digests(metadata, served.digests)
    assert state_problem(digested, assembled) is None
    return dict(
        model=model,
        config=str(MODELS[model].relative_to(ROOT)),
        parameters=sum(param.numel() for group in optimizer.param_groups for param in group["params"]),
        state_tensors=len(tensors),
        state_megabytes=round(sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 2**20, 1),
        repeats=repeats,
        donor_once_per_step_seconds=round(_median_time(serve, repeats), 4),
        donor_per_request_seconds=round(_median_time(lambda: serve(served), repeats), 6),
        receiver_check_seconds=round(_median_time(lambda: state_problem(digested, assembled), repeats), 4),
        download_serialization_seconds=round(
            _median_time(lambda: [deserialize_torch_tensor(tensor) for tensor in transfer()], repeats), 4
        ),
    )


# ---------------------------------------------------------------------------------------------- real downloads


def start_peer(initial_peers, digests: bool):
    from hivemind.averaging.averager import DecentralizedAverager

    from common.config import NetworkConfig
    from common.dht import start_dht

    if not digests:  # the same peer without verify_state_downloads: hivemind's download as it is
        DecentralizedAverager._verifies_state_downloads = True
    return start_dht(NetworkConfig(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"]))


def state_averager(dht, model: str, **options):
    from hivemind.optim.state_averager import TrainingStateAverager

    task, _ = build_model_and_optimizer(model)
    return TrainingStateAverager(
        dht=dht,
        optimizer=task.make_optimizer,
        params=task.optimizer_param_groups(),
        scheduler=task.make_scheduler,
        prefix=PREFIX,
        start=True,
        **options,
    )


def run_donor(args) -> None:
    dht = start_peer([], args.digests == "on")
    averager = state_averager(dht, args.model)
    averager.local_epoch = 7
    averager.state_sharing_priority = 7
    sys.stdout.write(f"READY {dht.get_visible_maddrs()[0]}\n")
    sys.stdout.flush()
    while True:
        time.sleep(1)


def run_receiver(args) -> None:
    dht = start_peer(args.initial_peers, args.digests == "on")
    averager = state_averager(dht, args.model, allow_state_sharing=False)
    deadline = time.monotonic() + 60
    while not dht.get(f"{PREFIX}.all_averagers", latest=True) and time.monotonic() < deadline:
        time.sleep(0.2)
    times = []
    for _ in range(args.downloads):
        averager.local_epoch = 0
        started = time.perf_counter()
        averager.load_state_from_peers(timeout=60)
        times.append(round(time.perf_counter() - started, 4))
        if averager.local_epoch != 7:
            times[-1] = None  # nothing loaded: not a download
    sys.stdout.write("RESULT " + json.dumps(times) + "\n")
    sys.stdout.flush()
    averager.shutdown()
    dht.shutdown()


def measure_downloads(model: str, downloads: int, digests: str) -> dict:
    import signal

    base = [sys.executable, __file__, "--model", model, "--digests", digests]
    donor = subprocess.Popen(
        [*base, "_donor"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
    try:
        line = donor.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError("the donor did not start")
        receiver = subprocess.run(
            [*base, "_receiver", "--downloads", str(downloads), "--initial-peers", line.split()[1]],
            capture_output=True,
            text=True,
            timeout=900,
            start_new_session=True,
        )
    finally:
        os.killpg(donor.pid, signal.SIGKILL)
        donor.wait(30)
    results = [line for line in receiver.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise RuntimeError(f"the receiver gave no result: {receiver.stderr[-2000:]}")
    times = json.loads(results[0].split(" ", 1)[1])
    done = [seconds for seconds in times if seconds is not None]
    return dict(
        model=model,
        digests=digests,
        downloads=len(times),
        loaded=len(done),
        seconds_each=times,
        first_seconds=times[0],
        median_seconds_after_first=statistics.median(done[1:]) if len(done) > 1 else None,
    )


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("hash", "download", "_donor", "_receiver"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--downloads", type=int, default=10)
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--digests", choices=("on", "off"), default="on")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.part == "_donor":
        return run_donor(args)
    if args.part == "_receiver":
        return run_receiver(args)
    import torch

    torch.set_num_threads(1)
    rows = []
    if args.part == "hash":
        measurements = (functools.partial(measure_hashing, model, args.repeats) for model in MODELS)
    else:  # alternating, so that a change in the machine's load falls on both
        measurements = (
            functools.partial(measure_downloads, "tiny", args.downloads, digests) for digests in ("off", "on") * 2
        )
    for measure in measurements:
        rows.append(measure())
        logger.info(json.dumps(rows[-1]))
        write_artefact(args, rows)  # after every row, so that a stopped run keeps what it measured


def write_artefact(args, rows) -> None:
    if args.out is not None:
        artefact = dict(
            command="python " + " ".join([str(Path(sys.argv[0])), *sys.argv[1:]]),
            machine=f"{platform.machine()} container, {os.cpu_count()} CPU cores shared with other jobs, no GPU, "
            "torch on 1 thread",
            date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            load_average_1min_at_end=round(os.getloadavg()[0], 1),
            rows=rows,
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(artefact, indent=1) + "\n")


if __name__ == "__main__":
    main()
