"""Per-peer training metrics in the DHT: signed, schema-validated records, aggregated per global step.

Each trainer stores, under ``<run_id>_metrics`` with its own public key as subkey, its summaries of its
global steps of the last ``monitor.metrics_expiration`` seconds. That key is the peer's identity key
(``common.identity``), so the subkey tells the monitor the peer id of the record's author: contributions are keyed
by peer id, and ``peer_name`` is only a label. Keeping a window means the monitor never misses a step because of
its polling period or a restart, and aggregating by the ``step`` field (not by arrival time) means stale steps
never mix.
Records are RSA-signed by hivemind's ``RSASignatureValidator`` (a peer can only write its own subkey) and
checked against the pydantic schema below (malformed records are refused by every DHT node).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator

# a peer republishes, every step, its step records of the last monitor.metrics_expiration seconds, at most this many:
# a monitor down for less than both (restart included) still finds every step it missed. Records are 200-400 bytes,
# so one peer's value stays under ~100 KB and forty peers' under hivemind's 4 MiB message limit
MAX_RECORDS_PUBLISHED = 256


class StepRecord(pydantic.BaseModel):
    """What one trainer contributed to one global step."""

    step: pydantic.conint(ge=0, strict=True)
    samples: pydantic.conint(ge=0, strict=True)
    loss: pydantic.StrictFloat
    seconds: pydantic.confloat(ge=0.0, strict=True)  # wall time this peer spent in the step
    time: pydantic.StrictFloat  # unix time when the step ended for this peer
    metrics: Dict[pydantic.StrictStr, pydantic.StrictFloat] = {}
    # this peer process's running totals since it started, at the end of the step: the monitor's compute
    # utilisation (samples computed that entered a global step; wall time spent computing gradients)
    computed_total: pydantic.conint(ge=0, strict=True) = 0
    used_total: pydantic.conint(ge=0, strict=True) = 0
    gradient_seconds_total: pydantic.confloat(ge=0.0, strict=True) = 0.0
    wall_seconds_total: pydantic.confloat(ge=0.0, strict=True) = 0.0


def records_to_publish(records: List[StepRecord], span_seconds: float) -> List[StepRecord]:
    """The step records a peer republishes: those that ended within ``span_seconds`` of its newest one, at most
    ``MAX_RECORDS_PUBLISHED`` (``records`` in the order they ended)."""
    if not records:
        return []
    newest = records[-1].time
    return [record for record in records[-MAX_RECORDS_PUBLISHED:] if record.time >= newest - span_seconds]


class PeerMetrics(pydantic.BaseModel):
    peer_name: pydantic.StrictStr
    role: pydantic.StrictStr
    recent: List[StepRecord]
    model_fingerprint: pydantic.StrictStr = ""  # parameter names and shapes: peers of one run must agree
    input_fingerprint: pydantic.StrictStr = ""  # what the inputs mean (e.g. a tokenizer's ids): the same
    software_fingerprint: pydantic.StrictStr = ""  # hivemind release + our patch set over it: the same


class MetricsSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, Optional[PeerMetrics]]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def make_validators(run_id: str, signature_validator: RSASignatureValidator) -> list:
    return [SchemaValidator(MetricsSchema, prefix=run_id), signature_validator]


@dataclass
class StepAggregate:
    """The swarm's view of one global step, built only from records that name that step."""

    step: int
    peers: int
    samples: int
    loss: float  # sample-weighted mean over peers
    seconds: float  # longest peer wall time for the step
    # when the step ended for the swarm: the earliest record of it. A peer that fell behind (a state reload, a
    # frozen laptop) publishes its record of the step later, up to the next step's end; with the latest record,
    # the next step would look like thousands of samples per second.
    time: float
    metrics: Dict[str, float]
    contributions: Dict[str, int]  # peer id -> samples
    names: Dict[str, str]  # peer id -> the display name it chose (names may repeat; peer ids do not)
    samples_per_second: Optional[float] = None  # the swarm's rate: samples / time since the previous step ended
    # peer id -> {"used_share", "compute_share"} from its running totals (peers that publish them)
    utilisation: Dict[str, Dict[str, float]] = field(default_factory=dict)

    @property
    def used_share(self) -> Optional[float]:
        """Of the samples this step's peers computed since they started, the share that entered a global step."""
        return _share(self.utilisation, "used_share", "computed_total")

    @property
    def compute_share(self) -> Optional[float]:
        """Of this step's peers' wall time since they started, the share spent computing gradients."""
        return _share(self.utilisation, "compute_share", "wall_seconds_total")

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "peers": self.peers,
            "samples": self.samples,
            "loss": self.loss,
            "seconds": self.seconds,
            "time": self.time,
            "metrics": self.metrics,
            "contributions": self.contributions,
            "names": self.names,
            "samples_per_second": self.samples_per_second,
            "utilisation": self.utilisation,
            "used_share": self.used_share,
            "compute_share": self.compute_share,
        }


def _share(utilisation: Dict[str, Dict[str, float]], share: str, weight: str) -> Optional[float]:
    """The swarm's share: the peers' shares weighted by what each share is of (samples or seconds)."""
    total = sum(peer[weight] for peer in utilisation.values())
    if total <= 0:
        return None
    return sum(peer[share] * peer[weight] for peer in utilisation.values()) / total


def peer_utilisation(record: StepRecord) -> Optional[Dict[str, float]]:
    """One peer's utilisation from its running totals, or None for a record without them."""
    if record.computed_total <= 0 or record.wall_seconds_total <= 0:
        return None
    return {
        "used_share": min(1.0, record.used_total / record.computed_total),
        "compute_share": min(1.0, record.gradient_seconds_total / record.wall_seconds_total),
        "computed_total": float(record.computed_total),
        "wall_seconds_total": record.wall_seconds_total,
    }


def aggregate_step(step: int, records: Dict[str, StepRecord], names: Optional[Dict[str, str]] = None) -> StepAggregate:
    """Combine the peers' records of ``step`` (keyed by peer id; weights: samples contributed)."""
    assert all(record.step == step for record in records.values()), "records of another step mixed in"
    total = sum(record.samples for record in records.values())
    weights = {name: (record.samples / total if total else 1.0 / len(records)) for name, record in records.items()}
    metric_names = sorted({name for record in records.values() for name in record.metrics})
    metrics = {
        metric: sum(
            weights[peer] * record.metrics[metric] for peer, record in records.items() if metric in record.metrics
        )
        / max(1e-12, sum(weights[peer] for peer, record in records.items() if metric in record.metrics))
        for metric in metric_names
    }
    return StepAggregate(
        step=step,
        peers=len(records),
        samples=total,
        loss=sum(weights[name] * record.loss for name, record in records.items()),
        seconds=max(record.seconds for record in records.values()),
        time=min(record.time for record in records.values()),
        metrics=metrics,
        contributions={peer: record.samples for peer, record in sorted(records.items())},
        names={peer: (names or {}).get(peer, peer) for peer in sorted(records)},
        utilisation={
            peer: utilisation
            for peer, utilisation in ((peer, peer_utilisation(records[peer])) for peer in sorted(records))
            if utilisation is not None
        },
    )


@dataclass
class StepAggregator:
    """Collects records by step and releases a step once the swarm is safely past it."""

    pending: Dict[int, Dict[str, StepRecord]] = field(default_factory=dict)
    names: Dict[str, str] = field(default_factory=dict)  # peer id -> display name
    finished_up_to: int = -1
    max_seen_step: int = -1
    last_step_time: Optional[float] = None  # when the previously released step ended (for the swarm's rate)

    def add(self, peer_id: str, peer_name: str, record: StepRecord) -> None:
        if record.step <= self.finished_up_to or not math.isfinite(record.loss):
            return
        self.pending.setdefault(record.step, {})[peer_id] = record
        self.names[peer_id] = peer_name
        self.max_seen_step = max(self.max_seen_step, record.step)

    def pop_ready(self, flush: bool = False) -> List[StepAggregate]:
        """Steps at least two behind the newest step seen (every peer has published them by then)."""
        ready = []
        for step in sorted(self.pending):
            if flush or step <= self.max_seen_step - 2:
                aggregate = aggregate_step(step, self.pending.pop(step), self.names)
                if self.last_step_time is not None and aggregate.time > self.last_step_time:
                    aggregate.samples_per_second = aggregate.samples / (aggregate.time - self.last_step_time)
                self.last_step_time = aggregate.time
                ready.append(aggregate)
                self.finished_up_to = max(self.finished_up_to, step)
        return ready


def contributor_labels(history: List[dict]) -> Dict[str, str]:
    """Peer id -> a unique readable label: the peer's name, with its peer id's tail where two peers share it."""
    names: Dict[str, str] = {}
    for entry in history:
        for peer in entry["contributions"]:
            names[peer] = entry.get("names", {}).get(peer, peer)
    shared = {name for name in names.values() if list(names.values()).count(name) > 1}
    return {peer: (f"{name}@{peer[-6:]}" if name in shared else name) for peer, name in names.items()}


class HistoryWriter:
    """Appends one JSON line per finished global step and mirrors it as CSV (human-friendly)."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = directory / "history.jsonl"
        self.csv_path = directory / "history.csv"

    def write(self, aggregate: StepAggregate) -> None:
        with self.jsonl_path.open("a") as jsonl:
            jsonl.write(json.dumps(aggregate.to_json()) + "\n")
        new_file = not self.csv_path.exists()
        metric_names = sorted(aggregate.metrics)
        with self.csv_path.open("a") as csv_file:
            if new_file:
                header = [
                    "step",
                    "peers",
                    "samples",
                    "samples_per_second",
                    "loss",
                    "seconds",
                    "time",
                    "used_share",
                    "compute_share",
                    *metric_names,
                ]
                csv_file.write(",".join(header) + "\n")
            rate = aggregate.samples_per_second
            values = [
                aggregate.step,
                aggregate.peers,
                aggregate.samples,
                "" if rate is None else f"{rate:.2f}",
                f"{aggregate.loss:.6f}",
                f"{aggregate.seconds:.3f}",
                f"{aggregate.time:.3f}",
                *(
                    "" if share is None else f"{share:.4f}"
                    for share in (aggregate.used_share, aggregate.compute_share)
                ),
                *(f"{aggregate.metrics[name]:.6f}" for name in metric_names),
            ]
            csv_file.write(",".join(str(value) for value in values) + "\n")

    def read(self) -> List[dict]:
        if not self.jsonl_path.exists():
            return []
        return [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line.strip()]
