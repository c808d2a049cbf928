"""hivemind all-reduce rounds over emulated volunteer links, timed against their bandwidth lower bound.

One worker process per emulated host (``common.tools.netns``) runs a hivemind ``DecentralizedAverager`` in its
namespace; the coordinator (:func:`run_setup`) starts them, collects per-round timings and summarises each
condition beside the bound.

Lower bound: peer i, with share w_i of the vector to reduce, sends (and receives) V * [own_i * (1 - w_i) +
w_i * d_i] bytes, where own_i = 1 for data-holding peers, d_i = number of *other* data-holding peers, and V
the compressed vector size; the round cannot end before the slowest link has moved its bytes. ``bound_uniform``
uses equal shares (2(N-1)/N * V over the slowest link for N data peers); ``bound_optimal`` the best shares (a
linear program, the same model hivemind's load balancer solves).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Dict, List, Sequence

from common.config import Compression
from common.errors import ConfigError, PeerError
from common.lifecycle import setup_logging
from common.optimizer import make_compression
from common.tools.netns import HOST_INTERFACE, EmulatedNetwork, HostSpec, NetworkSetup

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger(__name__)

UNIFORM_DECLARED_MBIT = 100.0  # any equal figure makes hivemind split the vector evenly
# the wire formats a round can use, and the bytes each element takes on the wire
BYTES_PER_ELEMENT = {Compression.fp16: 2, Compression.uniform8bit: 1, Compression.none: 4}


@dataclass
class Condition:
    index: int
    params: int
    split: str  # balanced | uniform
    aux: str  # with | without
    compression: str  # a Compression value: fp16 | uniform8bit | none


# ----------------------------------------------------------------------------------------------------------
# worker: one per emulated host, started inside its namespace
# ----------------------------------------------------------------------------------------------------------
def payload_vector(params: int, rank: int):
    """A gradient-sized payload whose exact average is known: a shared seeded pattern times (rank + 1)."""
    import torch

    from common.seeding import stable_seed

    generator = torch.Generator().manual_seed(stable_seed("averaging_benchmark", params) % (2**31))
    return torch.randn(params, generator=generator) * (rank + 1)


def link_counters() -> Dict[str, int]:
    """Bytes this host's interface has sent (its upload) and received (its download), per the kernel."""
    statistics_dir = Path("/sys/class/net") / HOST_INTERFACE / "statistics"
    return {key: int((statistics_dir / f"{key}_bytes").read_text()) for key in ("tx", "rx")}


def process_tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this worker and every live descendant: the DHT and averager processes and
    their libp2p daemon (p2pd) all run under it."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me] + me.children(recursive=True):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def sample(round_index: int) -> dict:
    return {
        "round": round_index,
        "time": time.time(),
        "cpu_s": process_tree_cpu_seconds(),
        "load1": os.getloadavg()[0],
        **link_counters(),
    }


class LinkTracer:
    """Samples this host's interface counters every ``interval`` seconds in a thread: when each direction of its
    link was busy within a round (does a peer's upload overlap its download?)."""

    def __init__(self, interval: float):
        import threading

        self.interval, self.trace = interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if interval > 0:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            counters = link_counters()
            self.trace.append((round(time.time(), 4), counters["tx"], counters["rx"]))

    def take(self) -> list:
        trace, self.trace = self.trace, []
        return trace

    def stop(self) -> None:
        self._stop.set()


def log_result_arrivals(path: Path) -> None:
    """Append (time, reducer index, part index) to ``path`` each time an averaged part arrives at this peer: when,
    within a round, results flow back (a diagnostic: it patches hivemind in this worker only)."""
    from hivemind.averaging.partition import TensorPartContainer

    register = TensorPartContainer.register_processed_part

    def logged(self, peer_index: int, part_index: int, part):
        with path.open("a") as handle:
            handle.write(json.dumps([time.time(), peer_index, part_index]) + "\n")
        return register(self, peer_index, part_index, part)

    TensorPartContainer.register_processed_part = logged


def log_daemon_handoffs(path: Path, min_bytes: int = 100_000) -> None:
    """Append (event, time, bytes) each time this peer hands a large message to its libp2p daemon ("sent": the
    daemon took it) or takes one from it ("received"): a message the reducer has produced but the daemon has not
    yet taken is held in Python; one the daemon took but whose bytes are not on the wire is held in the daemon."""
    from hivemind.p2p.p2p_daemon import P2P

    send, receive = P2P.send_protobuf, P2P.receive_protobuf

    def log(*event) -> None:
        with path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")

    async def logged_send(message, writer):
        size = message.ByteSize()
        await send(message, writer)
        if size >= min_bytes:
            log("sent", time.time(), size)

    async def logged_receive(message_type, reader):
        message, error = await receive(message_type, reader)
        if message is not None and message.ByteSize() >= min_bytes:
            log("received", time.time(), message.ByteSize())
        return message, error

    P2P.send_protobuf, P2P.receive_protobuf = staticmethod(logged_send), staticmethod(logged_receive)


def run_worker(plan: dict) -> None:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    from common import hivemind_patches

    # as every peer does; the "after-sending" rows measure hivemind's own delivery to zero-share peers
    held_back = () if plan["zero_share_results"] == "streamed" else ("stream_results_to_zero_share_full_peers",)
    hivemind_patches.install(without=held_back)
    if plan["trace_interval"] > 0:
        log_result_arrivals(Path(plan["results_file"]).with_name(f"arrivals_{plan['host']['name']}.jsonl"))
        log_daemon_handoffs(Path(plan["results_file"]).with_name(f"handoffs_{plan['host']['name']}.jsonl"))
    host = plan["host"]
    client_mode = not host["accepts_inbound"] and not plan["server_mode_behind_firewall"]
    results = Path(plan["results_file"])
    if plan["initial_peers_file"] is None:
        dht = hivemind.DHT(
            host_maddrs=[plan["host_maddr"]],
            use_relay=plan["use_relay"],
            use_auto_relay=plan["use_auto_relay"],
            start=True,
        )
        Path(plan["publish_file"]).write_text("\n".join(str(a) for a in dht.get_visible_maddrs()) + "\n")
    else:
        initial_peers = Path(plan["initial_peers_file"]).read_text().split()
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=[plan["host_maddr"]],
            client_mode=client_mode,
            use_relay=plan["use_relay"],
            use_auto_relay=plan["use_auto_relay"],
            start=True,
        )
    try:
        for condition in plan["conditions"]:
            if not condition["participates"]:
                continue
            original = payload_vector(condition["params"], plan["data_rank"])
            expected = original * (condition["expected_scale"] / (plan["data_rank"] + 1))
            averager = hivemind.DecentralizedAverager(
                [original.clone()],
                dht,
                start=True,
                prefix=f"bench{condition['index']}",
                target_group_size=condition["group_size"],
                min_group_size=condition["group_size"],
                min_matchmaking_time=plan["matchmaking_time"],
                request_timeout=3.0,
                allreduce_timeout=plan["allreduce_timeout"],
                compression=make_compression(Compression(condition["compression"])),
                part_size_bytes=plan["part_size_bytes"],
                sender_timeout=plan["sender_timeout"],
                reducer_timeout=2 * plan["sender_timeout"] if plan["sender_timeout"] else None,
                bandwidth=condition["declared_mbit"],
                auxiliary=host["role"] == "auxiliary",
                client_mode=client_mode,
            )
            samples, tracer = [], LinkTracer(plan["trace_interval"])
            try:
                for round_index in range(plan["rounds"] + 1):  # round 0 warms connections up
                    samples.append(sample(round_index))
                    with averager.get_tensors() as tensors:
                        tensors[0].copy_(original)
                    step_called = time.time()
                    control = averager.step(wait=False, timeout=plan["step_timeout"])
                    while not control.done() and control.stage != AveragingStage.RUNNING_ALLREDUCE:
                        time.sleep(0.002)
                    started = time.time()
                    try:
                        group = control.result()
                    except Exception as error:  # a failed round is recorded, not fatal: the next may succeed
                        group = None
                        logging.getLogger("worker").warning(f"round {round_index} failed: {error!r}")
                    finished = time.time()
                    with averager.get_tensors() as tensors:
                        relative_error = float((tensors[0] - expected).norm() / expected.norm())
                    record = {
                        "condition": condition["index"],
                        "round": round_index,
                        "host": host["name"],
                        "step_called": step_called,
                        "started": started,
                        "finished": finished,
                        "group_size": len(group) if group else 0,
                        "relative_error": relative_error if host["role"] != "auxiliary" else None,
                    }
                    with results.open("a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    # a barrier: a peer done with its own result may still be sending its reduced part to the
                    # others, so the next sample (and round) waits until every peer holds this round's average.
                    # It also keeps that traffic in this round's byte counts and (at the end) keeps a peer from
                    # shutting down while others still need its part.
                    wait_for_group(
                        results, condition["index"], round_index, condition["group_size"], plan["step_timeout"]
                    )
                samples.append(sample(plan["rounds"] + 1))
                summary = {"condition": condition["index"], "host": host["name"], "samples": samples}
                with results.open("a") as handle:
                    handle.write(json.dumps(dict(summary, trace=tracer.take())) + "\n")
            finally:
                tracer.stop()
                averager.shutdown()
    finally:
        dht.shutdown()


def wait_for_group(results: Path, condition: int, last_round: int, group_size: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = [
            record
            for record in map(json.loads, results.read_text().splitlines())
            if record["condition"] == condition and record.get("round") == last_round
        ]
        if len(finished) >= group_size:
            return
        time.sleep(0.2)


# ----------------------------------------------------------------------------------------------------------
# coordinator
# ----------------------------------------------------------------------------------------------------------
def link_bytes_per_peer(shares: Sequence[float], holds_data: Sequence[bool], vector_bytes: float) -> List[float]:
    data_peers = sum(holds_data)
    return [
        vector_bytes * ((1 - share) * own + share * (data_peers - own))
        for share, own in zip(shares, [int(flag) for flag in holds_data])
    ]


def round_time(shares, holds_data, links_mbit, vector_bytes) -> float:
    loads = link_bytes_per_peer(shares, holds_data, vector_bytes)
    return max((load * 8 / (link * 1e6) for load, link in zip(loads, links_mbit) if link is not None), default=0.0)


def lower_bounds(hosts: Sequence[HostSpec], vector_bytes: float) -> Dict[str, float]:
    """Bandwidth lower bounds (seconds) for equal shares and for the best shares (LP over w, minimising xi)."""
    import numpy as np
    import scipy.optimize

    holds_data = [host.role != "auxiliary" for host in hosts]
    can_reduce = [host.accepts_inbound for host in hosts]
    links = [host.link_mbit for host in hosts]
    reducers = sum(can_reduce)
    uniform = [1 / reducers if flag else 0.0 for flag in can_reduce]
    n = len(hosts)
    # variables [w_1..w_n, xi]; for capped peers: (bytes_i(w)) * 8 / (link_i * 1e6) <= xi
    data_peers = sum(holds_data)
    a_ub, b_ub = [], []
    for i, (own, link) in enumerate(zip(holds_data, links)):
        if link is None:
            continue
        scale = vector_bytes * 8 / (link * 1e6)
        row = [0.0] * (n + 1)
        row[i] = scale * ((data_peers - int(own)) - int(own))
        row[n] = -1.0
        a_ub.append(row)
        b_ub.append(-scale * int(own))
    if not a_ub:  # no capped link: only CPU limits the round
        return {"bound_uniform_s": 0.0, "bound_optimal_s": 0.0}
    bounds = [(0, 1 if flag else 0) for flag in can_reduce] + [(0, None)]
    solution = scipy.optimize.linprog(
        c=[0.0] * n + [1.0],
        A_ub=np.array(a_ub),
        b_ub=np.array(b_ub),
        A_eq=np.array([[1.0] * n + [0.0]]),
        b_eq=[1.0],
        bounds=bounds,
        method="highs",
    )
    if not solution.success:
        raise RuntimeError(f"lower-bound LP failed: {solution.message}")
    return {
        "bound_uniform_s": round_time(uniform, holds_data, links, vector_bytes),
        "bound_optimal_s": float(solution.fun),
    }


def wait_for_file(path: Path, processes: Sequence[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return
        if any(process.poll() is not None for process in processes):
            raise PeerError("the bootstrap averaging peer exited before publishing its address")
        time.sleep(0.1)
    raise PeerError(f"the bootstrap averaging peer did not publish its address within {timeout:.0f} s")


def stop_all(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def run_setup(setup: NetworkSetup, conditions: List[Condition], args) -> List[dict]:
    """Build the setup's network, run every condition with one worker per host, and summarise each."""
    hosts = [host for host in setup.hosts if host.role in ("trainer", "auxiliary")]
    bootstrap = next((i for i, host in enumerate(hosts) if host.accepts_inbound and host.role == "trainer"), None)
    if bootstrap is None:
        raise ConfigError(f"setup {setup.name}: needs a trainer host that accepts inbound connections")
    data_ranks = {}
    for host in hosts:
        if host.role == "trainer":
            data_ranks[host.name] = len(data_ranks)
    if args.rtt_ms:  # every host delays what it sends by half the round trip
        hosts = [replace(host, delay_ms=args.rtt_ms / 2) for host in hosts]
    network = EmulatedNetwork(
        hosts,
        queue_ms=args.queue_ms,
        congestion_control=args.congestion_control,
        notsent_lowat_bytes=args.notsent_lowat,
    )
    with network, TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        results_file, publish_file = workdir / "rounds.jsonl", workdir / "bootstrap_addresses.txt"
        order = [bootstrap] + [i for i in range(len(hosts)) if i != bootstrap]
        processes: List[subprocess.Popen] = []
        try:
            for i in order:
                host = hosts[i]
                plan = {
                    "host": asdict(host),
                    "host_maddr": network.host_maddr(i),
                    "results_file": str(results_file),
                    "initial_peers_file": None if i == bootstrap else str(publish_file),
                    "publish_file": str(publish_file),
                    "rounds": args.rounds,
                    "data_rank": data_ranks.get(host.name, 0),
                    "matchmaking_time": args.matchmaking_time,
                    "allreduce_timeout": args.allreduce_timeout,
                    "step_timeout": args.step_timeout,
                    "use_relay": args.use_relay,
                    "use_auto_relay": args.use_auto_relay,
                    "server_mode_behind_firewall": args.server_mode_behind_firewall,
                    "zero_share_results": args.zero_share_results,
                    "part_size_bytes": args.part_size_bytes,
                    "sender_timeout": args.sender_timeout,
                    "trace_interval": args.trace_interval,
                    "conditions": [worker_condition(condition, host, hosts, data_ranks) for condition in conditions],
                }
                plan_file = workdir / f"plan_{host.name}.json"
                plan_file.write_text(json.dumps(plan))
                log = (workdir / f"{host.name}.log").open("w")
                # pinning: each worker (and its DHT, averager and p2pd children) on one core, round robin
                pin = ["taskset", "-c", str(len(processes) % os.cpu_count())] if args.pin_cpus else []
                processes.append(
                    subprocess.Popen(
                        network.command_prefix(i) + pin + [sys.executable, "-m", __name__, str(plan_file)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
                if i == bootstrap:
                    wait_for_file(publish_file, processes, timeout=120)
            deadline = time.monotonic() + args.setup_timeout
            while time.monotonic() < deadline and any(process.poll() is None for process in processes):
                time.sleep(0.5)
                report_progress(results_file, conditions, args.rounds)
            timed_out = any(process.poll() is None for process in processes)
        finally:
            stop_all(processes)
        if timed_out or any(process.returncode != 0 for process in processes):
            tails = {hosts[i].name: (workdir / f"{hosts[i].name}.log").read_text()[-600:] for i in order}
            logger.warning(f"setup {setup.name}: workers {'timed out' if timed_out else 'failed'}; log tails: {tails}")
        records = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
        if args.trace_interval > 0:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            traces = [dict(r, setup=setup.name) for r in records if r.get("trace")]
            for trace in traces:
                arrivals = workdir / f"arrivals_{trace['host']}.jsonl"
                lines = arrivals.read_text().splitlines() if arrivals.exists() else []
                trace["result_arrivals"] = [json.loads(line) for line in lines]
                handoffs = workdir / f"handoffs_{trace['host']}.jsonl"
                lines = handoffs.read_text().splitlines() if handoffs.exists() else []
                trace["daemon_handoffs"] = [json.loads(line) for line in lines]
            (args.output_dir / f"{args.stem}_{setup.name}_traces.json").write_text(json.dumps(traces))
            plot_traces(traces, conditions, args.output_dir / f"{args.stem}_{setup.name}_traces.png")
    rows, peer_rows = [], []
    for condition in conditions:
        row = summarise(setup, hosts, condition, records, args.rounds)
        row.update(
            variant=args.variant,
            rtt_ms=args.rtt_ms,
            queue_ms=args.queue_ms,
            tcp=args.congestion_control,
            notsent_lowat=args.notsent_lowat,
        )
        row["matchmaking_s_median"] = median_matchmaking(condition, records, args.rounds)
        rows.append(row)
        peer_rows.extend(
            dict(r, variant=args.variant) for r in per_peer(setup, hosts, condition, records, args.rounds)
        )
    return rows, peer_rows


def worker_condition(condition: Condition, host: HostSpec, hosts: Sequence[HostSpec], data_ranks: dict) -> dict:
    members = [h for h in hosts if condition.aux == "with" or h.role != "auxiliary"]
    data_members = [h for h in members if h.role == "trainer"]
    mean_scale = statistics.mean(data_ranks[h.name] + 1 for h in data_members)
    declared = UNIFORM_DECLARED_MBIT if condition.split == "uniform" else host.link_mbit
    return {
        "index": condition.index,
        "params": condition.params,
        "compression": condition.compression,
        "participates": host in members,
        "group_size": len(members),
        "declared_mbit": declared,
        "expected_scale": mean_scale,
    }


def report_progress(results_file: Path, conditions: List[Condition], rounds: int) -> None:
    if not results_file.exists():
        return
    done = {
        json.loads(line)["condition"]
        for line in results_file.read_text().splitlines()
        if json.loads(line).get("round") == rounds
    }
    message = f"{len(done)}/{len(conditions)} conditions finished"
    if getattr(report_progress, "last", None) != message:
        report_progress.last = message
        logger.info(message)


def planned_shares(members: Sequence[HostSpec], condition: Condition) -> List[float]:
    """The shares hivemind's load balancer assigns this group: its own ``load_balance_peers`` on the bandwidths
    the peers declare (client-mode peers count as 0, as the averager passes them)."""
    from hivemind.averaging.load_balancing import load_balance_peers

    declared = [
        (UNIFORM_DECLARED_MBIT if condition.split == "uniform" else h.link_mbit) if h.accepts_inbound else 0.0
        for h in members
    ]
    return [size / condition.params for size in load_balance_peers(condition.params, declared)]


def per_peer(
    setup: NetworkSetup, hosts: Sequence[HostSpec], condition: Condition, records: List[dict], rounds: int
) -> List[dict]:
    """One row per peer and timed round: planned share and bytes beside the bytes its interface really moved,
    its CPU seconds (worker + DHT + averager + p2pd) and the round's wall time."""
    members = [h for h in hosts if condition.aux == "with" or h.role != "auxiliary"]
    shares = planned_shares(members, condition)
    holds_data = [h.role == "trainer" for h in members]
    vector_bytes = condition.params * BYTES_PER_ELEMENT[Compression(condition.compression)]
    planned = link_bytes_per_peer(shares, holds_data, vector_bytes)
    samples = {r["host"]: r["samples"] for r in records if r["condition"] == condition.index and "samples" in r}
    rows = []
    for round_index in range(1, rounds + 1):
        this_round = [r for r in records if r["condition"] == condition.index and r.get("round") == round_index]
        if not this_round:
            continue
        group_s = max(r["finished"] for r in this_round) - min(r["started"] for r in this_round)
        for host, share, planned_bytes in zip(members, shares, planned):
            own = next((r for r in this_round if r["host"] == host.name), None)
            host_samples = samples.get(host.name)
            if own is None or host_samples is None or len(host_samples) < round_index + 2:
                continue
            before, after = host_samples[round_index], host_samples[round_index + 1]
            rows.append(
                {
                    "setup": setup.name,
                    "params": condition.params,
                    "compression": condition.compression,
                    "split": condition.split,
                    "aux": condition.aux,
                    "round": round_index,
                    "host": host.name,
                    "link_mbit": host.link_mbit,
                    "share_planned": round(share, 4),
                    "planned_up_MB": round(planned_bytes / 1e6, 3),
                    "observed_up_MB": round((after["tx"] - before["tx"]) / 1e6, 3),
                    "planned_down_MB": round(planned_bytes / 1e6, 3),
                    "observed_down_MB": round((after["rx"] - before["rx"]) / 1e6, 3),
                    "peer_round_s": round(own["finished"] - own["started"], 3),
                    "group_round_s": round(group_s, 3),
                    "cpu_s": round(after["cpu_s"] - before["cpu_s"], 3),
                    "wall_s": round(after["time"] - before["time"], 3),
                    "load1": round(before["load1"], 2),
                }
            )
    return rows


def median_matchmaking(condition: Condition, records: List[dict], rounds: int) -> float:
    """Median over timed rounds of the longest a peer spent between ``step()`` and the all-reduce starting."""
    waits = []
    for round_index in range(1, rounds + 1):
        this_round = [r for r in records if r["condition"] == condition.index and r.get("round") == round_index]
        if this_round:
            waits.append(max(r["started"] - r["step_called"] for r in this_round))
    return round(statistics.median(waits), 3) if waits else float("nan")


def summarise(
    setup: NetworkSetup, hosts: Sequence[HostSpec], condition: Condition, records: List[dict], rounds: int
) -> dict:
    members = [h for h in hosts if condition.aux == "with" or h.role != "auxiliary"]
    vector_bytes = condition.params * BYTES_PER_ELEMENT[Compression(condition.compression)]
    bounds = lower_bounds(members, vector_bytes)
    times, errors = [], []
    for round_index in range(1, rounds + 1):
        this_round = [r for r in records if r["condition"] == condition.index and r.get("round") == round_index]
        if len(this_round) == len(members) and all(r["group_size"] == len(members) for r in this_round):
            times.append(max(r["finished"] for r in this_round) - min(r["started"] for r in this_round))
            errors.extend(r["relative_error"] for r in this_round if r["relative_error"] is not None)
    median = statistics.median(times) if times else float("nan")
    loads = [
        sample["load1"]
        for r in records
        if r["condition"] == condition.index and "samples" in r
        for sample in r["samples"]
    ]
    return {
        "setup": setup.name,
        "peers": sum(h.role == "trainer" for h in members),
        "aux_peers": sum(h.role == "auxiliary" for h in members),
        "client_mode_peers": sum(not h.accepts_inbound for h in members),
        "params": condition.params,
        "compression": condition.compression,
        "split": condition.split,
        "aux": condition.aux,
        "rounds_ok": len(times),
        "rounds": rounds,
        "round_s_median": round(median, 3),
        "round_s_min": round(min(times), 3) if times else float("nan"),
        "bound_optimal_s": round(bounds["bound_optimal_s"], 3),
        "bound_uniform_s": round(bounds["bound_uniform_s"], 3),
        "ratio_to_optimal_bound": round(median / bounds["bound_optimal_s"], 3)
        if times and bounds["bound_optimal_s"] > 0
        else float("nan"),
        "max_relative_l2_error": f"{max(errors):.2e}" if errors else "",
        "load1_mean": round(statistics.mean(loads), 2) if loads else float("nan"),
    }


def write_csv(rows: List[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_outputs(rows: List[dict], peer_rows: List[dict], output_dir: Path, stem: str) -> None:
    """<stem>.csv/.md/.png: one row per condition; <stem>_peers.csv/_bytes.png: per peer and round."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, output_dir / f"{stem}.csv")
    if peer_rows:
        write_csv(peer_rows, output_dir / f"{stem}_peers.csv")
        plot_bytes(peer_rows, output_dir / f"{stem}_bytes.png")
    columns = [
        "setup",
        "peers",
        "aux_peers",
        "client_mode_peers",
        "params",
        "compression",
        "split",
        "aux",
        "rounds_ok",
        "round_s_median",
        "bound_optimal_s",
        "bound_uniform_s",
        "ratio_to_optimal_bound",
        "max_relative_l2_error",
        "load1_mean",
        "variant",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    (output_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(rows, output_dir / f"{stem}.png")


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['setup']} {r['params'] / 1e6:g}M {r['compression']} {r['split']} aux {r['aux']} {r['variant']}".strip()
        for r in rows
    ]
    positions = range(len(rows))
    figure, axis = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 5.5))
    axis.bar([p - 0.2 for p in positions], [r["round_s_median"] for r in rows], width=0.4, label="measured (median)")
    axis.bar(
        [p + 0.2 for p in positions],
        [r["bound_optimal_s"] for r in rows],
        width=0.4,
        label="bandwidth lower bound (best split)",
    )
    axis.set_xticks(list(positions))
    axis.set_xticklabels(labels, fontsize=7, rotation=35, ha="right")
    axis.set_ylabel("seconds per all-reduce round")
    axis.set_title("hivemind all-reduce over emulated links (2-core CPU container)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_bytes(peer_rows: List[dict], path: Path) -> None:
    """Per condition and peer: planned vs observed upload and download (mean over rounds), in MB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: Dict[tuple, Dict[str, List[dict]]] = {}
    for row in peer_rows:
        key = (row["setup"], row["params"], row["compression"], row["split"], row["aux"], row["variant"])
        groups.setdefault(key, {}).setdefault(row["host"], []).append(row)
    figure, axes = plt.subplots(len(groups), 1, figsize=(8, 2.6 * len(groups)), squeeze=False)
    bars = [("planned_up_MB", "planned up"), ("observed_up_MB", "observed up")]
    bars += [("planned_down_MB", "planned down"), ("observed_down_MB", "observed down")]
    for axis, (key, by_host) in zip(axes[:, 0], groups.items()):
        names = list(by_host)
        for offset, (column, label) in enumerate(bars):
            means = [statistics.mean(r[column] for r in by_host[name]) for name in names]
            axis.bar([i + (offset - 1.5) * 0.2 for i in range(len(names))], means, width=0.2, label=label)
        axis.set_xticks(range(len(names)))
        axis.set_xticklabels(
            [f"{n} ({by_host[n][0]['link_mbit']} Mb/s, share {by_host[n][0]['share_planned']:.2f})" for n in names],
            fontsize=7,
        )
        axis.set_ylabel("MB per round")
        axis.set_title(" ".join(str(k) for k in key if k != ""), fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_traces(traces: List[dict], conditions: List[Condition], path: Path) -> None:
    """Per condition: each peer's upload and download rate (Mb/s) through the last timed round, with the moments
    averaged parts arrived at it (ticks): shows whether a peer's download overlaps its upload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(conditions), 1, figsize=(9, 3 * len(conditions)), squeeze=False)
    for axis, condition in zip(axes[:, 0], conditions):
        for trace in (t for t in traces if t["condition"] == condition.index):
            samples = trace["samples"]
            start, end = samples[-2]["time"], samples[-1]["time"]  # the last timed round, barrier to barrier
            points = [p for p in trace["trace"] if start <= p[0] <= end]
            for column, style in ((1, "-"), (2, ":")):
                times = [(b[0] + a[0]) / 2 - start for a, b in zip(points, points[1:])]
                rates = [(b[column] - a[column]) * 8 / (b[0] - a[0]) / 1e6 for a, b in zip(points, points[1:])]
                label = f"{trace['host']} {'up' if column == 1 else 'down'}"
                line = axis.plot(times, rates, style, label=label, linewidth=1)[0]
            arrivals = [a[0] - start for a in trace.get("result_arrivals", []) if start <= a[0] <= end]
            axis.plot(arrivals, [-5] * len(arrivals), "|", color=line.get_color(), markersize=6)
        axis.set_title(f"{condition.params / 1e6:g}M {condition.compression} {condition.split}", fontsize=9)
        axis.set_ylabel("Mb/s")
        axis.legend(fontsize=6, ncol=4)
    axes[-1, 0].set_xlabel("seconds since the round's barrier (ticks below 0: averaged parts arriving)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":  # a worker: python -m common.tools.allreduce PLAN_FILE, started by run_setup
    setup_logging(f"worker {Path(sys.argv[1]).stem}")
    run_worker(json.loads(Path(sys.argv[1]).read_text()))
