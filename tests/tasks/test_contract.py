"""The contract every task keeps with the core, checked on its ``configs/<task>/tiny.yaml``:

    pytest tests/tasks/test_contract.py --task mytask      (default: --task template)

* the collaborative optimizer builder fills in the task's optimizer state before the first step, changing nothing;
* a swarm of two trainers ends where one process ends on the same samples (sync equivalence);
* a peer with a different model is refused before it averages;
* the export is a Hugging Face folder that ``from_pretrained`` reloads to the same outputs, its card stating the
  weights' own step.
"""

from __future__ import annotations

import pytest
import torch

from common.backends import RunFingerprints, require_same_model
from common.config import import_task_module, load_config
from common.errors import PeerError
from common.metrics import PeerMetrics, metrics_key
from common.task import ExportFacts
from tests.helpers import (
    EQUIVALENCE_OVERRIDES,
    ROOT,
    assert_no_processes_left,
    degraded_rounds,
    differences_from_replay,
    run_trainers,
)

# What a task's tiny config needs for the contract to run in about a minute: fewer documents to prepare, and no
# dropout (it draws from each process's own RNG, so no two processes could agree). A new task adds its line if its
# tiny config needs one; equivalence settings shared by every task come from tests/helpers.py.
TASK_OVERRIDES = {
    "template": ["task.max_documents=2000"],
    "albert": ["task.max_documents=3000", "task.classifier_dropout_prob=0.0"],
}
FAST = [
    "monitor.wandb_mode=disabled",
    "monitor.refresh_seconds=0.5",
    "training.log_every_seconds=5",
    "collaboration.final_averaging_seconds=3",
]


@pytest.fixture(scope="module")
def task_name(request) -> str:
    return request.config.getoption("--task")


@pytest.fixture(scope="module")
def config_path(task_name) -> str:
    path = ROOT / "configs" / task_name / "tiny.yaml"
    assert path.is_file(), f"the contract runs a task on its configs/{task_name}/tiny.yaml: none found"
    return str(path)


@pytest.fixture(scope="module")
def overrides(task_name) -> list:
    return [*FAST, *TASK_OVERRIDES.get(task_name, [])]


@pytest.fixture(scope="module")
def built(config_path, overrides):
    """The task with its data (one trainer's view) and its config."""
    config = load_config(config_path, overrides)
    torch.manual_seed(config.training.seed)
    return config, import_task_module(config.task_module).build_task(config)


def test_the_optimizer_builder_prefills_the_task_optimizer_state(built):
    import hivemind

    from common.optimizer import make_collaborative_optimizer

    config, task = built
    before = {name: param.detach().clone() for name, param in task.model.named_parameters()}
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    optimizer = None
    try:
        optimizer = make_collaborative_optimizer(dht, task, config.collaboration, config.training.local_batch_size)
        inner = optimizer.state_averager.optimizer
        params = [param for group in inner.param_groups for param in group["params"]]
        missing = [index for index, param in enumerate(params) if not inner.state[param]]
        assert params and not missing, f"no optimizer state before the first step for parameters {missing[:5]}"
        counters = [state["step"] for state in inner.state.values() if "step" in state]
        counters += [group["step"] for group in inner.param_groups if "step" in group]
        assert all(float(counter) == 0 for counter in counters), "a hidden step ran before training"
        for name, param in task.model.named_parameters():
            assert torch.equal(param, before[name]), f"{name} changed before the first step"
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_trainers_end_where_one_process_ends_on_the_same_samples(config_path, overrides, tmp_path):
    steps = 3
    run_overrides = [
        *overrides,
        *(item for item in EQUIVALENCE_OVERRIDES if not item.startswith("task.")),  # the generic ones
        "debug.record_sample_ids=true",
        f"training.max_global_steps={steps}",
        "collaboration.target_batch_size=512",
        "monitor.checkpoint_every_steps=0",
    ]
    trainers = ["trainer0", "trainer1"]
    try:
        run_trainers(config_path, tmp_path, run_overrides, trainers, timeout=360)
    finally:
        assert_no_processes_left(tmp_path)
    # float32 sums in another order (butterfly all-reduce vs one accumulator): ~1e-7
    differences = differences_from_replay(config_path, tmp_path, run_overrides, trainers, steps)
    degraded = degraded_rounds([tmp_path / name for name in trainers])
    assert max(differences) < 1e-5 and not degraded, (differences, degraded)


def test_a_peer_with_another_model_is_refused(built):
    import hivemind
    from hivemind.utils import get_dht_time

    config, task = built
    run = RunFingerprints.of(task)
    other = import_task_module(config.task_module).build_task(config, with_data=False)
    other.model.add_module("extra_layer", torch.nn.Linear(2, 2))  # one more tensor than the run's model
    run_id = config.collaboration.run_id
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        record = PeerMetrics(
            peer_name="trainer0", role="trainer", recent=[], model_fingerprint=run.model, input_fingerprint=run.inputs
        )
        dht.store(metrics_key(run_id), record.dict(), get_dht_time() + 60, subkey=b"trainer0")
        require_same_model(dht, run_id, run, task.input_mismatch_advice)  # the same model joins
        with pytest.raises(PeerError, match="trains a different model"):
            require_same_model(dht, run_id, RunFingerprints(RunFingerprints.of(other).model, run.inputs))
        if run.inputs:  # a task whose inputs need encoding (a tokenizer): another encoding is refused too
            with pytest.raises(PeerError, match="encodes its inputs differently"):
                require_same_model(dht, run_id, RunFingerprints(run.model, "another encoding"))
    finally:
        dht.shutdown()


def test_the_export_reloads_to_the_same_outputs(built, tmp_path):
    config, task = built
    facts = ExportFacts(
        run_id=config.collaboration.run_id,
        global_step=3,
        samples=1536,
        exported_by="the contract test",
        backend="collaborative",
        final_loss=5.5,
        contributors=[{"peer": "peer-a", "samples": 1536, "steps": 3}],
    )
    folder = task.export_pretrained(task.model, tmp_path / "hf_model", facts)
    assert folder is not None and (folder / "config.json").is_file(), "the task wrote no Hugging Face folder"
    assert not (tmp_path / "hf_model.partial").exists()
    reloaded = type(task.model).from_pretrained(folder).eval()
    batch = next(iter(task.batches(stream_seed=0)))
    task.model.eval()
    with torch.no_grad():
        original, loaded = task.forward(task.model, batch), task.forward(reloaded, batch)
    assert torch.equal(original.loss, loaded.loss) and original.metrics == loaded.metrics
    card = (folder / "README.md").read_text()
    assert "| global steps | 3 |" in card and "| training loss of global step 2 | 5.5000 |" in card
    if getattr(task, "tokenizer", None) is not None:
        from transformers import AutoTokenizer

        text = "The river flows into the sea near the old town."
        assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == task.tokenizer(text)["input_ids"]
