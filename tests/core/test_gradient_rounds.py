"""With delayed gradient averaging (``dpu``) every trainer starts each gradient round at its update: none looks for
the next group while the previous round runs, and every update gets a round of its own."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import hivemind
import pytest
from hivemind.utils import get_dht_time

from common.config import CollaborationConfig, Semantics
from common.hivemind_compat import gradient_rounds_start_at_the_update
from common.optimizer import make_collaborative_optimizer
from tests.helpers import OneWeightTask
from tests.leftovers import leaves_nothing_behind  # noqa: F401 (the fixture, for usefixtures)

MATCHMAKING_SECONDS = 2.0


class Round:
    """What the optimizer asks of a gradient round's ``StepControl``."""

    def __init__(self, triggered: bool = False, finished: bool = False):
        self.triggered, self.finished = triggered, finished

    def done(self) -> bool:
        return self.finished


class GradientAverager:
    """Records the rounds the optimizer schedules (``schedule_step``) and starts at its update (``step``)."""

    matchmaking_kwargs = {"min_matchmaking_time": MATCHMAKING_SECONDS}

    def __init__(self):
        self.scheduled, self.started = [], []

    def schedule_step(self, timeout):
        self.scheduled.append(Round())
        return self.scheduled[-1]

    def step(self, control=None, reset_accumulators=True, wait=False):
        self.started.append(control)
        return Round(triggered=True) if control is None else control


def trainer(scheduled_grads, seconds_to_update: float = 1.0, patched: bool = True) -> SimpleNamespace:
    """The fields of ``hivemind.Optimizer`` that scheduling and starting a gradient round read."""
    optimizer = SimpleNamespace(
        use_gradient_averaging=True,
        matchmaking_time=MATCHMAKING_SECONDS,
        averaging_timeout=30.0,
        status_loglevel=logging.DEBUG,
        scheduled_grads=scheduled_grads,
        scheduled_state=None,
        grad_averager=GradientAverager(),
        tracker=SimpleNamespace(
            estimated_next_update_time=get_dht_time() + seconds_to_update,
            global_progress=SimpleNamespace(num_peers=3),
        ),
        _maybe_schedule_gradient_averaging=lambda: hivemind.Optimizer._maybe_schedule_gradient_averaging(optimizer),
        _begin_averaging_gradients=lambda scaler: hivemind.Optimizer._begin_averaging_gradients(optimizer, scaler),
    )
    if patched:
        gradient_rounds_start_at_the_update(optimizer)
    return optimizer


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("previous", [None, Round(triggered=True), Round(triggered=True, finished=True)])
def test_no_round_is_pre_scheduled(previous, patched):
    optimizer = trainer(previous, patched=patched)
    optimizer._maybe_schedule_gradient_averaging()
    # hivemind looks for the next group before the update, even while the previous round still runs
    assert len(optimizer.grad_averager.scheduled) == (0 if patched else 1)
    assert optimizer.scheduled_grads is (previous if patched else optimizer.grad_averager.scheduled[0])


@pytest.mark.parametrize("previous", [Round(triggered=True, finished=True), Round(finished=True)])
@pytest.mark.parametrize("patched", [False, True])
def test_an_update_without_a_round_of_its_own_starts_one(previous, patched):
    """The previous step's round (or a scheduled one that failed) is all the trainer has at its update."""
    optimizer = trainer(previous, patched=patched)
    began = optimizer._begin_averaging_gradients(None)
    # hivemind starts no round: the trainer would apply its own gradients as if they were the swarm's average
    assert began is patched
    assert optimizer.grad_averager.started == ([None] if patched else [])


def test_a_scheduled_round_is_the_one_started():
    scheduled = Round()
    optimizer = trainer(scheduled)
    assert optimizer._begin_averaging_gradients(None) is True
    assert optimizer.grad_averager.started == [scheduled]


@pytest.mark.usefixtures("leaves_nothing_behind")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("semantics, patched", [(Semantics.sync, False), (Semantics.dpu, True)])
def test_dpu_optimizers_get_it(semantics, patched):
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        collab = CollaborationConfig(run_id="gradient_rounds_test", semantics=semantics)
        optimizer = make_collaborative_optimizer(dht, OneWeightTask(), collab, local_batch_size=4)
        try:
            assert ("_begin_averaging_gradients" in vars(optimizer)) is patched
            assert ("_maybe_schedule_gradient_averaging" in vars(optimizer)) is patched
        finally:
            optimizer.shutdown()
    finally:
        dht.shutdown()
