"""One process with dpu's update rule: each global step applies the previous step's gradient."""

from __future__ import annotations

import pytest
import torch

from common.backends import SingleProcessBackend
from common.config import CollaborationConfig, Semantics
from common.errors import ConfigError
from common.precision import Precision
from tests.helpers import OneWeightTask

SYNC = CollaborationConfig(target_batch_size=4)
DPU = CollaborationConfig(target_batch_size=4, semantics=Semantics.dpu)


def weight_after_each_step(backend: SingleProcessBackend, gradients) -> list:
    weight = backend.task.model.weight
    seen = []
    for gradient in gradients:
        weight.grad = torch.full_like(weight, gradient)
        assert backend.step(batch_size=backend.target_batch_size) is not None  # one micro-batch = one global step
        backend.zero_grad()
        seen.append(float(weight.detach()))
    return seen


def test_synchronous_steps_apply_their_own_gradient():
    backend = SingleProcessBackend(OneWeightTask(), SYNC)
    assert weight_after_each_step(backend, [-1.0, -2.0, -3.0]) == [1.0, 3.0, 6.0]


def test_delayed_updates_apply_the_previous_steps_gradient_and_the_last_one_at_the_end():
    backend = SingleProcessBackend(OneWeightTask(), DPU)
    assert weight_after_each_step(backend, [-1.0, -2.0, -3.0]) == [0.0, 1.0, 3.0]
    backend.finalize()  # as a dpu peer applies its last background update when it stops
    assert float(backend.task.model.weight.detach()) == 6.0


def test_a_resumed_run_applies_the_gradient_held_back_before_the_checkpoint():
    first = SingleProcessBackend(OneWeightTask(), DPU)
    weight_after_each_step(first, [-1.0, -2.0])
    state = first.checkpoint_state()
    resumed = SingleProcessBackend(OneWeightTask(), DPU)
    resumed.load_checkpoint_state(state)
    assert resumed.global_step == 2
    assert weight_after_each_step(resumed, [-3.0]) == [3.0]  # step 1's -2 applied, step 2's -3 held back


def test_delayed_updates_refuse_loss_scaling_in_one_line():
    with pytest.raises(ConfigError, match="needs training.precision fp32 or bf16, not fp16"):
        SingleProcessBackend(OneWeightTask(), DPU, Precision.fp16)
