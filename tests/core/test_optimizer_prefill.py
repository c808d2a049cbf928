"""Optimizer state prefill (common.optimizer.prefill_optimizer_state) and what the optimizer builder hands hivemind."""

import logging

import pytest
import torch
from timm.optim import Lamb, Lars

from common.config import CollaborationConfig
from common.optimizer import make_collaborative_optimizer, prefill_optimizer_state
from tests.helpers import OneWeightTask

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=0.1, amsgrad=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "timm_lamb": lambda params: Lamb(params, lr=0.1, weight_decay=0.1, always_adapt=True),
    "timm_lars": lambda params: Lars(params, lr=0.1, momentum=0.9, weight_decay=0.01, trust_clip=False),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=generator)).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_prefill_creates_every_statistic_and_changes_nothing_else(name):
    model = _model()
    before = [param.detach().clone() for param in model.parameters()]
    optimizer = prefill_optimizer_state(OPTIMIZERS[name](model.parameters()))
    assert all(torch.equal(param, saved) for param, saved in zip(model.parameters(), before))
    assert all(param.grad is None for param in model.parameters())
    assert all(optimizer.state[param] for param in model.parameters())  # hivemind finds tensors for every param
    counters = [state["step"] for state in optimizer.state.values() if "step" in state]
    counters += [group["step"] for group in optimizer.param_groups if "step" in group]
    assert counters or name in ("sgd_momentum", "timm_lars")  # SGD-style optimizers count nothing
    assert all(float(counter) == 0 for counter in counters)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_prefilled_optimizer_trains_exactly_like_a_fresh_one(name):
    fresh_model, prefilled_model = _model(), _model()
    _train(fresh_model, OPTIMIZERS[name](fresh_model.parameters()), steps=3)
    _train(prefilled_model, prefill_optimizer_state(OPTIMIZERS[name](prefilled_model.parameters())), steps=3)
    for fresh, prefilled in zip(fresh_model.parameters(), prefilled_model.parameters()):
        assert torch.equal(fresh, prefilled)


def test_stateless_optimizer_is_left_without_state():
    model = _model()
    optimizer = prefill_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1))
    assert not any(optimizer.state.values())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_builder_prefills_and_hands_the_declared_bandwidth_to_both_averagers(caplog):
    """hivemind 1.1.12 passes ``averager_opts`` to the state averager only; the gradient averager's rounds are the
    ones load balancing matters for. No virtual zero-gradient step runs and hivemind logs no line about one."""
    import hivemind

    dht = hivemind.DHT(start=True)
    task = OneWeightTask()
    with torch.no_grad():
        task.model.weight.fill_(2.0)
    task.make_optimizer = lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    collab = CollaborationConfig(run_id="prefill_test", target_batch_size=4, bandwidth=7.5)
    optimizer = None
    try:
        with caplog.at_level(logging.INFO):
            optimizer = make_collaborative_optimizer(dht, task, collab, local_batch_size=1)
        assert optimizer.grad_averager.bandwidth == 7.5
        assert optimizer.state_averager.bandwidth == 7.5
        assert float(task.model.weight) == 2.0  # a zero-gradient AdamW step with weight decay would shrink it
        assert "Initializing optimizer manually" not in caplog.text
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
