"""The collaborative optimizer skips a step whose averaged gradient is not finite (a partial all-reduce): the fix
``skip_nonfinite_steps``. ``--without-patch skip_nonfinite_steps`` fails these tests."""

from __future__ import annotations

import asyncio

import torch
from hivemind.averaging.partition import TensorPartReducer

from common.hivemind_compat import skip_nonfinite_steps


def make_guarded_sgd(weight: torch.nn.Parameter):
    optimizer = skip_nonfinite_steps(torch.optim.SGD([weight], lr=0.5))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # wraps optimizer.step too
    return optimizer, scheduler


def test_finite_gradient_steps_normally():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer, scheduler = make_guarded_sgd(weight)
    weight.grad = torch.full((3,), 2.0)
    optimizer.step()
    scheduler.step()
    assert torch.equal(weight.detach(), torch.zeros(3))


def test_nonfinite_gradient_leaves_parameters_and_state_untouched(caplog):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = skip_nonfinite_steps(torch.optim.Adam([weight], lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    weight.grad = torch.tensor([1.0, float("nan"), 1.0])
    optimizer.step()
    scheduler.step()
    assert torch.equal(weight.detach(), torch.ones(3))
    assert optimizer.state[weight] == {}  # no moment was updated with NaN
    assert "optimizer step skipped" in caplog.text
    weight.grad = torch.ones(3)
    optimizer.step()
    assert bool(torch.isfinite(weight).all()) and not torch.equal(weight.detach(), torch.ones(3))


def test_a_round_where_only_zero_weight_peers_got_through_is_skipped():
    """hivemind's reducer divides a part by the total weight it received: when the one peer with samples fails
    before sending it and only a zero-weight peer (tagging along) got through, the average is 0/0."""

    async def average_of_a_cut_round() -> torch.Tensor:
        reducer = TensorPartReducer([torch.Size([3])], num_senders=2)
        reducer.on_sender_failed(0)  # the peer with samples, before its part arrived
        return await reducer.accumulate_part(1, 0, torch.ones(3), weight=0.0)

    average = asyncio.run(average_of_a_cut_round())
    assert torch.isnan(average).all()  # the fault: hivemind hands this average to every peer of the round

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer, scheduler = make_guarded_sgd(weight)
    weight.grad = average
    optimizer.step()
    scheduler.step()
    assert torch.equal(weight.detach(), torch.ones(3))
