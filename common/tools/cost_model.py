"""Cost and time model for collaborative training (DeDLOC) and its HPC baseline.

A global step takes

    step = accumulation + averaging              (semantics sync / local: the averaging round blocks)
    step = max(accumulation, averaging)          (semantics dpu: averaging overlaps the next accumulation)
    step = accumulation + averaging / H          (semantics diloco: one pseudo-gradient round every H = inner_steps
                                                  global steps, blocking; no gradient or state rounds between)

    accumulation = target_batch_size / sum_i(samples_per_second_i * availability_i)

Averaging (a swarm) is hivemind's butterfly all-reduce of an S-byte vector (parameters x bytes/param on the
wire). The split w_i comes from hivemind itself, ``hivemind.averaging.load_balancing.load_balance_peers``
(the linear program DeDLOC's load balancing solves: min xi s.t. (1 + (n-2) w_i) / b_i <= xi, sum w_i = 1,
client-mode peers w_i = 0), fed with each peer's bandwidth min(upload, download) exactly as hivemind's
averager is fed its declared bandwidth. Given the split, peer i moves

    sender (trainer)     upload = download = S * (1 - w_i) + S * w_i * (n_senders - 1) = S * (1 + (n_senders - 2) w_i)
    auxiliary (no grads) upload = download = S * w_i * n_senders
    client mode (w_i=0)  upload = download = S

and the round lasts  T = round_overhead + max_i max(upload_i / up_i, download_i / down_i): every peer
streams both directions at its link rate, so the slowest link finishes last. ``round_overhead`` is the
fixed matchmaking/RPC cost of one round (measured, per setup). The gradient round runs every global step, on
the critical path; a state (parameter) round runs every ``average_state_every`` steps in the background, as
hivemind.Optimizer does by default (``delay_state_averaging``), so it costs wall time only where it outlasts the
next accumulation.

A diloco swarm's pseudo-gradient is parameter-sized, so its round moves the same S bytes as a gradient round, H
times less often. The model predicts time per global step only: whether diloco reaches a given loss in as many
samples as ``sync`` is a property of the recipe it does not know (``paper_results/comparison/diloco`` measures it
at small scale).

An HPC node uses a ring all-reduce over its interconnect: T = overhead + 2 (n-1)/n * S / B, and keeps
parameters in sync without state rounds.

Preemptible nodes: with ``interruptions_per_hour`` r and ``restart_minutes`` m, a node is up a fraction
1 / (1 + r * m / 60) of the time, contributes that fraction of its throughput and is billed only while up.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
from hivemind.averaging.load_balancing import load_balance_peers
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import Semantics, require
from common.errors import ConfigError, DataError

BITS_PER_BYTE = 8
MEGABIT = 1e6
GIGABIT = 1e9
SECONDS_PER_HOUR = 3600.0


class NodeRole(str, enum.Enum):
    trainer = "trainer"  # computes gradients
    auxiliary = "auxiliary"  # CPU peer: no gradients, only a share of the all-reduce
    monitor = "monitor"  # coordinator: bootstraps the DHT and logs; costs money, takes no part in averaging


class Pricing(str, enum.Enum):
    on_demand = "on_demand"
    preemptible = "preemptible"
    owned = "owned"  # volunteers' or lab hardware: the price is a rental-equivalent stand-in


class SetupKind(str, enum.Enum):
    swarm = "swarm"  # peers over the internet, hivemind butterfly all-reduce
    hpc = "hpc"  # one node, GPUs on a fast interconnect, ring all-reduce


@dataclass
class NodeGroup:
    """``count`` identical machines. Every figure has a source string beside it (or says 'assumption')."""

    name: str = "nodes"
    count: int = 1
    accelerator: str = "cpu"
    role: NodeRole = NodeRole.trainer
    samples_per_second: Dict[str, float] = field(default_factory=dict)  # per task name, per machine
    throughput_source: str = "assumption"
    upload_mbps: float = 1000.0
    download_mbps: float = 1000.0
    bandwidth_source: str = "assumption"
    usd_per_hour: float = 0.0  # per machine
    pricing: Pricing = Pricing.on_demand
    price_source: str = "assumption"
    interruptions_per_hour: float = 0.0
    restart_minutes: float = 0.0  # respawn + load_state_from_peers after an interruption
    client_mode: bool = False  # no inbound connections: sends its gradients, never aggregates

    def __post_init__(self) -> None:
        where = f"nodes[{self.name}]"
        require(self.count >= 1, f"{where}.count must be >= 1")
        require(self.upload_mbps > 0 and self.download_mbps > 0, f"{where}.upload_mbps/download_mbps must be > 0")
        require(self.usd_per_hour >= 0, f"{where}.usd_per_hour must be >= 0")
        require(self.interruptions_per_hour >= 0, f"{where}.interruptions_per_hour must be >= 0")
        require(self.restart_minutes >= 0, f"{where}.restart_minutes must be >= 0")
        require(
            all(rate > 0 for rate in self.samples_per_second.values()),
            f"{where}.samples_per_second values must be > 0",
        )
        require(
            not (self.role == NodeRole.auxiliary and self.client_mode),
            f"{where}: an auxiliary peer must accept inbound connections (client_mode must be false)",
        )
        require(
            self.role == NodeRole.trainer or not self.samples_per_second,
            f"{where}: only trainers compute gradients (samples_per_second must be empty for a {self.role.value})",
        )

    @property
    def availability(self) -> float:
        return 1.0 / (1.0 + self.interruptions_per_hour * self.restart_minutes / 60.0)


@dataclass
class SetupConfig:
    name: str = "setup"
    description: str = ""
    kind: SetupKind = SetupKind.swarm
    semantics: Semantics = Semantics.sync
    round_overhead_seconds: float = 1.0  # matchmaking + RPC latency of one averaging round
    round_overhead_source: str = "assumption"
    interconnect_gbps: Optional[float] = None  # hpc only: per-GPU all-reduce bandwidth
    interconnect_source: str = "assumption"
    nodes: List[NodeGroup] = field(default_factory=list)
    inner_steps: int = 1  # semantics diloco: global steps between two pseudo-gradient rounds (DiLoCo's H)

    def __post_init__(self) -> None:
        require(len(self.nodes) > 0, f"setup {self.name}: nodes must list at least one node group")
        require(self.inner_steps >= 1, f"setup {self.name}: inner_steps must be >= 1")
        require(
            self.semantics != Semantics.diloco or self.kind == SetupKind.swarm,
            f"setup {self.name}: semantics diloco needs a swarm (an hpc node averages over its interconnect)",
        )
        require(self.round_overhead_seconds >= 0, "round_overhead_seconds must be >= 0")
        require(
            any(group.role == NodeRole.trainer for group in self.nodes),
            f"setup {self.name}: needs at least one trainer node group",
        )
        if self.kind == SetupKind.hpc:
            require(
                self.interconnect_gbps is not None and self.interconnect_gbps > 0,
                f"setup {self.name}: an hpc setup needs interconnect_gbps > 0",
            )
        else:
            require(
                any(not group.client_mode for group in self.nodes),
                f"setup {self.name}: every peer is in client mode, so nobody can aggregate the all-reduce",
            )


@dataclass
class TaskSpec:
    name: str = "task"
    parameters: int = 0  # elements averaged per round
    parameters_source: str = "assumption"
    bytes_per_parameter: float = 2.0  # on the wire (fp16)
    target_batch_size: int = 4096
    global_steps: int = 1
    global_steps_source: str = "assumption"
    average_state_every: int = 1  # state (parameter) round every k global steps; 0 = never

    def __post_init__(self) -> None:
        require(self.parameters > 0, f"task {self.name}: parameters must be > 0")
        require(self.bytes_per_parameter > 0, f"task {self.name}: bytes_per_parameter must be > 0")
        require(self.target_batch_size > 0, f"task {self.name}: target_batch_size must be > 0")
        require(self.global_steps > 0, f"task {self.name}: global_steps must be > 0")
        require(self.average_state_every >= 0, f"task {self.name}: average_state_every must be >= 0")

    @property
    def vector_bytes(self) -> float:
        return self.parameters * self.bytes_per_parameter


def _load_structured(schema, path: Path):
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        message = str(error).strip().splitlines()[0]
        raise ConfigError(f"{path}: {key + ': ' if key else ''}{message}") from None
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    except Exception as error:  # yaml parse errors come in many types
        raise ConfigError(f"cannot parse {path}: {str(error).splitlines()[0]}") from None


def load_setup(path: str | Path) -> SetupConfig:
    return _load_structured(SetupConfig, Path(path))


def load_task_spec(path: str | Path) -> TaskSpec:
    return _load_structured(TaskSpec, Path(path))


@dataclass(frozen=True)
class MeasuredThroughput:
    """One GPU's measured samples/s per task spec: a trainer node group's ``samples_per_second`` and its source."""

    device: str
    samples_per_second: Dict[str, float]
    source: str  # for ``NodeGroup.throughput_source``


def load_measured_throughput(path: str | Path) -> MeasuredThroughput:
    """The ``cost_model`` entry of a GPU checks' results.json (scripts/experiments/gpu_throughput.py): our loop's
    samples/s per task spec, measured after the first global step, in the precision the device trains at."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"measured throughput file not found: {path}")
    try:
        results = json.loads(path.read_text())
        entry = results["cost_model"]
        rates = {str(task): float(rate) for task, rate in entry["samples_per_second"].items()}
        device, precision, loop = str(entry["device"]), str(entry["precision"]), str(entry["loop"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(f"{path} is not a GPU checks' results.json with a cost_model entry ({error!r})") from None
    if not rates or not all(np.isfinite(rate) and rate > 0 for rate in rates.values()):
        raise DataError(f"{path}: cost_model.samples_per_second must give each task a rate > 0 (got {rates})")
    if results.get("tiny"):
        raise DataError(f"{path} holds a smoke run of the tiny configs, not the paper's models")
    source = f"measured: {device}, {precision}, {loop} loop, {results.get('date', 'date not recorded')} ({path.name})"
    return MeasuredThroughput(device=device, samples_per_second=rates, source=source)


# ----------------------------------------------------------------------------------------------- all-reduce


@dataclass(frozen=True)
class Peer:
    """One peer as the averaging model sees it."""

    upload_mbps: float
    download_mbps: float
    sends_vector: bool = True  # trainers send their gradients; auxiliary peers only aggregate
    client_mode: bool = False

    @property
    def declared_bandwidth(self) -> float:
        return 0.0 if self.client_mode else min(self.upload_mbps, self.download_mbps)


def butterfly_shares(vector_size: int, peers: Sequence[Peer]) -> np.ndarray:
    """Fractions of the vector each peer aggregates, as hivemind's own load balancer splits it."""
    if not any(peer.declared_bandwidth > 0 for peer in peers):
        raise ConfigError("all-reduce needs at least one peer that accepts inbound connections (not client mode)")
    parts = np.asarray(load_balance_peers(vector_size, [peer.declared_bandwidth for peer in peers]), dtype=np.float64)
    return parts / parts.sum()


def butterfly_seconds(vector_bytes: float, peers: Sequence[Peer], shares: Optional[np.ndarray] = None) -> float:
    """Transfer time of one butterfly all-reduce (no fixed overhead); see the module docstring."""
    if shares is None:
        shares = butterfly_shares(max(1, int(round(vector_bytes))), peers)
    senders = sum(1 for peer in peers if peer.sends_vector)
    if senders == 0:
        raise ConfigError("all-reduce needs at least one peer that sends a vector (a trainer)")
    if senders == 1 and len(peers) == 1:
        return 0.0
    longest = 0.0
    for peer, share in zip(peers, shares):
        if peer.sends_vector:
            volume = vector_bytes * (1.0 + (senders - 2) * share)
        else:
            volume = vector_bytes * share * senders
        seconds = max(volume / peer.upload_mbps, volume / peer.download_mbps) * BITS_PER_BYTE / MEGABIT
        longest = max(longest, seconds)
    return float(longest)


def ring_allreduce_seconds(vector_bytes: float, workers: int, interconnect_gbps: float) -> float:
    if workers <= 1:
        return 0.0
    return 2.0 * (workers - 1) / workers * vector_bytes * BITS_PER_BYTE / (interconnect_gbps * GIGABIT)


# ----------------------------------------------------------------------------------------------- prediction


@dataclass
class Prediction:
    setup: str
    task: str
    semantics: str
    trainers: int
    auxiliaries: int
    swarm_samples_per_second: float
    accumulation_seconds: float
    averaging_seconds: float  # per global step, state rounds amortised
    step_seconds: float
    total_hours: float
    total_cost_usd: float
    usd_per_hour: float  # the whole setup while training

    def to_row(self) -> Dict[str, object]:
        return {
            "setup": self.setup,
            "task": self.task,
            "semantics": self.semantics,
            "trainers": self.trainers,
            "auxiliaries": self.auxiliaries,
            "swarm_samples_per_second": round(self.swarm_samples_per_second, 2),
            "accumulation_s": round(self.accumulation_seconds, 3),
            "averaging_s": round(self.averaging_seconds, 3),
            "step_s": round(self.step_seconds, 3),
            "total_hours": round(self.total_hours, 1),
            "total_days": round(self.total_hours / 24.0, 2),
            "usd_per_hour": round(self.usd_per_hour, 3),
            "total_cost_usd": round(self.total_cost_usd, 0),
        }


def expand_peers(nodes: Sequence[NodeGroup]) -> List[Peer]:
    return [
        Peer(
            upload_mbps=group.upload_mbps,
            download_mbps=group.download_mbps,
            sends_vector=group.role == NodeRole.trainer,
            client_mode=group.client_mode,
        )
        for group in nodes
        if group.role != NodeRole.monitor
        for _ in range(group.count)
    ]


def combine_step_time(accumulation: float, averaging: float, semantics: Semantics) -> float:
    if semantics == Semantics.dpu:
        return max(accumulation, averaging)
    return accumulation + averaging


def swarm_averaging_seconds(
    task: TaskSpec,
    peers: Sequence[Peer],
    round_overhead: float,
    accumulation_seconds: float,
    semantics: Semantics = Semantics.sync,
    inner_steps: int = 1,
) -> float:
    """Averaging time per global step on the critical path: the gradient round, plus whatever part of the
    (amortised) background state round the next accumulation does not hide; for diloco the pseudo-gradient
    round, amortised over its ``inner_steps`` global steps."""
    one_round = round_overhead + butterfly_seconds(task.vector_bytes, peers)
    if semantics == Semantics.diloco:
        return one_round / inner_steps
    state_rounds_per_step = 1.0 / task.average_state_every if task.average_state_every else 0.0
    return one_round + max(0.0, one_round * state_rounds_per_step - accumulation_seconds)


def as_diloco(setup: SetupConfig, inner_steps: int) -> SetupConfig:
    """The same swarm running ``semantics=diloco`` with ``inner_steps`` (named ``<setup>_diloco_h<H>``)."""
    return dataclasses.replace(
        setup,
        name=f"{setup.name}_diloco_h{inner_steps}",
        description=f"{setup.description} (diloco, an outer round every {inner_steps} global steps)",
        semantics=Semantics.diloco,
        inner_steps=inner_steps,
    )


def predict(setup: SetupConfig, task: TaskSpec) -> Prediction:
    trainers = [group for group in setup.nodes if group.role == NodeRole.trainer]
    missing = [group.name for group in trainers if task.name not in group.samples_per_second]
    if missing:
        raise ConfigError(
            f"setup {setup.name}: node groups {missing} give no samples_per_second for task {task.name!r}"
        )
    throughput = sum(group.count * group.samples_per_second[task.name] * group.availability for group in trainers)
    accumulation = task.target_batch_size / throughput
    if setup.kind == SetupKind.hpc:
        workers = sum(group.count for group in trainers)
        averaging = setup.round_overhead_seconds + ring_allreduce_seconds(
            task.vector_bytes, workers, setup.interconnect_gbps
        )
    else:
        averaging = swarm_averaging_seconds(
            task,
            expand_peers(setup.nodes),
            setup.round_overhead_seconds,
            accumulation,
            setup.semantics,
            setup.inner_steps,
        )
    step = combine_step_time(accumulation, averaging, setup.semantics)
    total_hours = step * task.global_steps / SECONDS_PER_HOUR
    usd_per_hour = sum(group.count * group.usd_per_hour * group.availability for group in setup.nodes)
    return Prediction(
        setup=setup.name,
        task=task.name,
        semantics=setup.semantics.value,
        trainers=sum(group.count for group in trainers),
        auxiliaries=sum(group.count for group in setup.nodes if group.role == NodeRole.auxiliary),
        swarm_samples_per_second=throughput,
        accumulation_seconds=accumulation,
        averaging_seconds=averaging,
        step_seconds=step,
        total_hours=total_hours,
        total_cost_usd=usd_per_hour * total_hours,
        usd_per_hour=usd_per_hour,
    )


# ----------------------------------------------------------------------------------------------- validation


@dataclass
class Validation:
    steps_measured: int
    peers: float  # mean trainers per step
    samples_per_step: float
    swarm_samples_per_second: float
    predicted_accumulation_seconds: float
    predicted_averaging_seconds: float
    predicted_step_seconds: float
    measured_step_seconds: float  # median interval between consecutive global steps

    @property
    def relative_error(self) -> float:
        return (self.predicted_step_seconds - self.measured_step_seconds) / self.measured_step_seconds

    def to_json(self) -> dict:
        return {**self.__dict__, "relative_error": self.relative_error}


def fit_round_overhead(predict_step_seconds: Callable[[float], float], measured_step_seconds: float) -> float:
    """The fixed per-round overhead (matchmaking, RPC, scheduling) for which the model predicts a run's measured
    step time (0 if even no overhead over-predicts): calibrate on one run, then validate on a different one."""
    low, high = 0.0, max(1.0, measured_step_seconds)
    if predict_step_seconds(low) >= measured_step_seconds:
        return 0.0
    for _ in range(60):  # predicted step time grows monotonically with the overhead
        middle = (low + high) / 2
        low, high = (middle, high) if predict_step_seconds(middle) < measured_step_seconds else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class SwarmCalibration:
    """This machine's inputs to the step-time model, fitted on recorded runs of the same swarm."""

    swarm_samples_per_second: float  # compute throughput of all trainers together, as the swarm really got it
    round_overhead_seconds: float  # matchmaking, RPC and scheduling per averaging round


def fit_swarm_calibration(first: Validation, second: Validation, semantics: Semantics) -> SwarmCalibration:
    """Two runs of one swarm with different target batches (both validated with zero overhead) determine its
    effective throughput (the slope of step time over samples per step) and its per-round overhead (the rest).
    Assumes the background state round hides behind the accumulation in both runs (one round on the critical path)."""
    if semantics == Semantics.dpu:
        raise DataError("the model can only be calibrated on sync or local runs (dpu overlaps averaging)")
    extra_samples = second.samples_per_step - first.samples_per_step
    extra_seconds = second.measured_step_seconds - first.measured_step_seconds
    if abs(extra_samples) < 1 or extra_samples * extra_seconds <= 0:
        raise DataError(
            f"calibration needs two runs whose larger target batch takes longer per step (got "
            f"{first.samples_per_step:.0f} samples in {first.measured_step_seconds:.2f} s and "
            f"{second.samples_per_step:.0f} in {second.measured_step_seconds:.2f} s)"
        )
    throughput = extra_samples / extra_seconds
    waiting = first.measured_step_seconds - first.samples_per_step / throughput - first.predicted_averaging_seconds
    return SwarmCalibration(swarm_samples_per_second=throughput, round_overhead_seconds=max(0.0, waiting))


def validate_against_history(
    history: Sequence[Mapping],
    peer_samples_per_second: Mapping[str, float],
    parameters: int,
    bytes_per_parameter: float,
    bandwidth_mbps: float,
    round_overhead_seconds: float,
    average_state_every: int,
    semantics: Semantics = Semantics.sync,
    auxiliary_peers: int = 0,
    skip_first_steps: int = 1,
    peers: Optional[Sequence[Peer]] = None,
) -> Validation:
    """Predicted vs measured time per global step for a run recorded by the monitor (``history.jsonl``).

    ``peer_samples_per_second`` is each trainer's *compute* throughput under the run's CPU sharing (take it
    from trainers run with ``training.backend=single`` side by side, whose wall rate has no averaging in it).
    Every peer gets the same measured link ``bandwidth_mbps`` (loopback), unless ``peers`` lists each trainer
    and auxiliary peer with its own link (an emulated setup).
    """
    records = sorted(history, key=lambda record: record["step"])[skip_first_steps:]
    if len(records) < 2:
        raise DataError(
            f"need at least {skip_first_steps + 2} global steps in the history to measure a step time "
            f"(got {len(history)})"
        )
    if not peer_samples_per_second:
        raise DataError("no trainer throughput given (no summary.json with samples_per_second found)")
    intervals = [
        later["time"] - earlier["time"]
        for earlier, later in zip(records, records[1:])
        if later["step"] == earlier["step"] + 1
    ]
    if not intervals:
        raise DataError("the history has no two consecutive global steps")
    samples_per_step = float(np.mean([record["samples"] for record in records]))
    mean_peers = float(np.mean([record["peers"] for record in records]))
    throughput = float(sum(peer_samples_per_second.values()))
    trainers = len(peer_samples_per_second)
    if peers is None:
        peers = [Peer(bandwidth_mbps, bandwidth_mbps)] * trainers + [
            Peer(bandwidth_mbps, bandwidth_mbps, sends_vector=False)
        ] * auxiliary_peers
    task = TaskSpec(
        name="measured",
        parameters=parameters,
        bytes_per_parameter=bytes_per_parameter,
        target_batch_size=max(1, int(round(samples_per_step))),
        average_state_every=average_state_every,
    )
    accumulation = samples_per_step / throughput
    averaging = swarm_averaging_seconds(task, peers, round_overhead_seconds, accumulation)
    return Validation(
        steps_measured=len(intervals),
        peers=mean_peers,
        samples_per_step=samples_per_step,
        swarm_samples_per_second=throughput,
        predicted_accumulation_seconds=accumulation,
        predicted_averaging_seconds=averaging,
        predicted_step_seconds=combine_step_time(accumulation, averaging, semantics),
        measured_step_seconds=float(median(intervals)),
    )
