"""The monitor names the all-client-mode trap: when its checkpoint downloads have failed for minutes and no other
peer declares its state for download (hivemind shares a state only from non-auxiliary peers that accept
connections), it logs one warning naming network.client_mode and the fix, instead of only its per-attempt retries
(the sahajBERT rehearsal of paper_results/fullscale ran into it with 17 such retries and no hint)."""

import logging
import time
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from common.metrics import StepAggregator
from common.roles import monitor as monitor_module
from common.roles.monitor import Monitor

OWN, OTHER = PeerID(b"monitor-peer-id-bytes"), PeerID(b"trainer-peer-id-bytes")


class FakeDHT:
    def __init__(self, declared: dict):
        self.peer_id, self.declared, self.keys = OWN, declared, []

    def get(self, key, latest=False):
        self.keys.append(key)
        return ValueWithExpiration(self.declared, time.time() + 60) if self.declared else None


class NothingServed:
    """A state averager whose download finds nothing newer (hivemind returns without loading)."""

    prefix, local_epoch = "run_state_averager", 0

    def load_state_from_peers(self, timeout=None):
        return None


def failing_monitor(declared: dict) -> Monitor:
    monitor = Monitor.__new__(Monitor)
    monitor.config = SimpleNamespace(
        monitor=SimpleNamespace(checkpoint_every_steps=1), collaboration=SimpleNamespace(load_state_timeout=1.0)
    )
    monitor.state_averager, monitor.dht = NothingServed(), FakeDHT(declared)
    monitor.aggregator = StepAggregator()
    monitor.aggregator.max_seen_step = 7
    monitor.last_checkpoint_step = 0
    monitor.checkpoint_failures, monitor.next_checkpoint_attempt = 0, 0.0
    monitor.failing_since, monitor.warned_no_state_servers = None, False
    return monitor


def entry(value) -> ValueWithExpiration:
    return ValueWithExpiration(value, time.time() + 60)


def attempts(monitor: Monitor, count: int) -> None:
    for _ in range(count):
        monitor.next_checkpoint_attempt = 0.0
        monitor.maybe_checkpoint()


def cause_warnings(caplog) -> list:
    return [record.getMessage() for record in caplog.records if "network.client_mode" in record.getMessage()]


def test_one_warning_names_client_mode_when_no_peer_offers_a_state(caplog):
    # the monitor's own declaration (its checkpoint) and the auxiliary peer's None do not serve the swarm's state
    monitor = failing_monitor({OWN.to_bytes(): entry(0), OTHER.to_bytes(): entry(None)})
    caplog.set_level(logging.WARNING, logger=monitor_module.__name__)
    attempts(monitor, 3)
    assert cause_warnings(caplog) == []  # not before STATE_SERVERS_WARNING_SECONDS of failures
    monitor.failing_since -= monitor_module.STATE_SERVERS_WARNING_SECONDS
    attempts(monitor, 3)
    (warning,) = cause_warnings(caplog)
    assert "network.client_mode=false" in warning and "global step 7" in warning and "(global step 0)" in warning
    assert monitor.dht.keys[0] == "run_state_averager.all_averagers"


def test_no_warning_while_some_trainer_offers_its_state(caplog):
    # a trainer that declares a state but whose download fails (a slow link) is a different problem
    monitor = failing_monitor({OWN.to_bytes(): entry(0), OTHER.to_bytes(): entry(5)})
    caplog.set_level(logging.WARNING, logger=monitor_module.__name__)
    attempts(monitor, 1)
    monitor.failing_since -= monitor_module.STATE_SERVERS_WARNING_SECONDS
    attempts(monitor, 3)
    assert cause_warnings(caplog) == []
    assert monitor.checkpoint_failures == 4


def test_a_served_checkpoint_resets_the_failure_clock():
    monitor = failing_monitor({})
    attempts(monitor, 1)
    assert monitor.failing_since is not None
    monitor.state_averager.local_epoch = 8  # a newer state arrived
    # a non-finite state is refused before anything is written: enough to see the clock reset without a disk
    monitor.task = SimpleNamespace(model=SimpleNamespace(parameters=lambda: [torch.tensor(float("nan"))]))
    attempts(monitor, 1)
    assert monitor.failing_since is None and monitor.checkpoint_failures == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_count_reads_what_real_hivemind_averagers_declare():
    """The key, its subkeys (peer ids as bytes) and a non-sharing peer's None as hivemind 1.1.12 writes them."""
    prefix = "run_state_averager"
    first = hivemind.DHT(start=True)
    other = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs())
    averagers = []
    try:
        monitor = failing_monitor({})
        monitor.dht, monitor.state_averager = first, SimpleNamespace(prefix=prefix)

        def averager(dht, sharing: bool):
            averagers.append(
                hivemind.DecentralizedAverager(
                    [torch.zeros(2)], dht, prefix=prefix, target_group_size=2, start=True, allow_state_sharing=sharing
                )
            )

        averager(first, True)  # the monitor's own declaration does not count
        averager(other, False)  # an auxiliary or client-mode peer declares None
        time.sleep(2.0)
        assert monitor.state_servers() == 0
        averagers[-1].allow_state_sharing = True  # re-declared at once with its priority
        deadline = time.monotonic() + 30
        while monitor.state_servers() == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert monitor.state_servers() == 1
    finally:
        for each in averagers:
            each.shutdown()
        other.shutdown()
        first.shutdown()
