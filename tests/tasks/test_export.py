"""A trained model leaves a run as a Hugging Face folder that the ecosystem's loaders accept as it is, with a card
that states the facts of the checkpoint it was written from (ALBERT here; tests/tasks/test_contract.py checks any
task's round trip)."""

import json
import logging

import pytest
import torch
from transformers import AlbertForPreTraining, AutoTokenizer

from albert.corpus import OFFLINE_WIKIPEDIA, load_documents
from albert.task import AlbertTask
from albert.tokenizer import train_unigram_tokenizer
from common.export import export_transformers_model, facts_at_step, model_card
from common.task import ExportFacts
from tests.helpers import ROOT, run_script, small_albert_config

TINY_ALBERT = str(ROOT / "configs/albert/tiny.yaml")
SMALL = small_albert_config()
FACTS = ExportFacts(
    run_id="export_test",
    global_step=7,
    samples=7 * 384,
    exported_by="the test",
    backend="collaborative",
    final_loss=6.125,
    metrics={"mlm_accuracy": 0.25},
    contributors=[{"peer": "peer-a", "samples": 2000, "steps": 7}, {"peer": "peer-b", "samples": 688, "steps": 3}],
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.set_num_threads(1)
    tokenizer = train_unigram_tokenizer(load_documents(OFFLINE_WIKIPEDIA, None, 200), SMALL.vocab_size)
    torch.manual_seed(0)
    task = AlbertTask(SMALL, 4, None, SMALL.vocab_size, tokenizer)
    folder = task.export_pretrained(task.model, tmp_path_factory.mktemp("run") / "hf_model", FACTS)
    return task, tokenizer, folder


def test_exported_folder_loads_with_the_ecosystem_loaders(exported):
    task, tokenizer, folder = exported
    assert (folder / "model.safetensors").is_file() and not (folder / "pytorch_model.bin").exists()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "albert"
    model = AlbertForPreTraining.from_pretrained(folder).eval()
    original = task.model.eval()
    for name, value in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = ["The river flows into the sea.", "It was built in 1900."]
    assert loaded_tokenizer(*text)["input_ids"] == tokenizer(*text)["input_ids"]
    batch = loaded_tokenizer(*text, return_tensors="pt")
    with torch.no_grad():
        assert torch.allclose(model(**batch).prediction_logits, original(**batch).prediction_logits)


def test_model_card_states_the_run(exported):
    _, _, folder = exported
    card = (folder / "README.md").read_text()
    for fact in ("export_test", "| global steps | 7 |", "| samples | 2688 |", "6.1250", "mlm_accuracy | 0.2500"):
        assert fact in card, fact
    assert card.index("peer-a") < card.index("peer-b")  # contributors ranked by samples
    assert "offline English Wikipedia" in card and "AlbertForPreTraining.from_pretrained" in card


def test_pushing_without_a_reachable_hub_is_one_clear_line(exported, tmp_path):
    _, _, folder = exported
    model = AlbertForPreTraining.from_pretrained(folder)
    torch.save({"step": 7, "model": model.state_dict()}, tmp_path / "step_0000007.pt")
    overrides = [f"task.{key}={value}" for key, value in vars(SMALL).items() if key != "stream" and value is not None]
    overrides = [item for item in overrides if not item.startswith(("task.betas", "task.cache_dir"))]
    result = run_script(
        "scripts/export_model.py",
        "--config",
        TINY_ALBERT,
        "--checkpoint",
        str(tmp_path / "step_0000007.pt"),
        "--output",
        str(tmp_path / "out"),
        "--push-to-hub",
        "someone/albert-tiny",
        *overrides,
        f"task.cache_dir={tmp_path / 'cache'}",
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr[-1500:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot push")
    reloaded = AlbertForPreTraining.from_pretrained(tmp_path / "out")  # the folder was written before the push
    assert torch.equal(
        reloaded.albert.embeddings.word_embeddings.weight, model.albert.embeddings.word_embeddings.weight
    )
    assert "| global steps | 7 |" in (tmp_path / "out" / "README.md").read_text()


def test_finetune_names_an_unreachable_hub_model_in_one_line():
    result = run_script(
        "scripts/finetune.py", "--task", "wiki_topic", "--model", "neuropark/sahajBERT", env={"HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot load hub model 'neuropark/sahajBERT'")


def test_finetune_fine_tunes_an_exported_folder(exported, tmp_path):
    _, _, folder = exported
    result = run_script(
        "scripts/finetune.py",
        "--task",
        "wiki_topic",
        "--model",
        str(folder),
        "--seeds",
        "1",
        "--epochs",
        "1",
        "--max-length",
        "32",
        "--max-train-examples",
        "64",
        "--max-eval-examples",
        "32",
        "--output",
        str(tmp_path / "result.json"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "result.json").read_text())
    assert summary["model"] == str(folder) and 0.0 <= summary["test_mean"] <= 1.0


def _history(steps: int) -> list:
    """A monitor's history rows for steps 0 .. steps-1: two peers, loss 20 - step."""
    return [
        {
            "step": step,
            "samples": 300,
            "loss": 20.0 - step,
            "metrics": {"mlm_accuracy": step / 100},
            "contributions": {"id-a": 200, "id-b": 100},
            "names": {"id-a": "peer-a", "id-b": "peer-b"},
        }
        for step in range(steps)
    ]


def test_a_checkpoint_card_states_its_own_step_not_the_latest_one(exported):
    task = exported[0]
    # a step-11 checkpoint exported after the history reached step 14: the loss of step 10, samples of steps 0-10
    facts = facts_at_step(_history(15), 11, run_id="r", exported_by="the test", backend="collaborative")
    assert (facts.global_step, facts.final_loss, facts.loss_step, facts.samples) == (11, 10.0, 10, 3300)
    assert facts.metrics == {"mlm_accuracy": 0.1}
    assert facts.contributors == [
        {"peer": "peer-a", "samples": 2200, "steps": 11},
        {"peer": "peer-b", "samples": 1100, "steps": 11},
    ]
    card = model_card(task.model, facts, albert_card_text(), has_tokenizer=False)
    assert "| global steps | 11 |" in card and "| training loss of global step 10 | 10.0000 |" in card


def test_a_monitor_card_ahead_of_its_history_names_the_step_its_loss_is_of(exported):
    task = exported[0]
    # the monitor checkpointed step 4 while its history held steps 0-1 (it aggregates a step after the swarm took it)
    facts = facts_at_step(
        _history(2), 4, run_id="r", exported_by="the test", backend="collaborative", samples_per_step=300
    )
    assert (facts.final_loss, facts.loss_step, facts.samples) == (19.0, 1, 1200)
    card = model_card(task.model, facts, albert_card_text(), has_tokenizer=False)
    assert "| training loss of global step 1 | 19.0000 (step 3, these weights' last update, was not yet" in card
    nothing = facts_at_step([], 4, run_id="r", exported_by="the test", backend="collaborative")
    assert "| training loss of global step 3 | not recorded |" in model_card(
        task.model, nothing, albert_card_text(), has_tokenizer=False
    )


def albert_card_text():
    from albert.export import albert_card

    return albert_card("test data")


def test_a_failing_export_is_one_error_line_and_keeps_the_previous_folder(exported, tmp_path, monkeypatch, caplog):
    task, tokenizer, _ = exported
    folder = export_transformers_model(task.model, tmp_path / "hf_model", FACTS, tokenizer)
    assert folder is not None
    before = sorted(path.name for path in folder.iterdir())

    def disk_full(directory, **_options):
        (tmp_path / "hf_model.partial").mkdir(exist_ok=True)
        (tmp_path / "hf_model.partial" / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(task.model, "save_pretrained", disk_full)
    with caplog.at_level(logging.INFO, logger="common.export"):
        assert export_transformers_model(task.model, folder, FACTS, tokenizer) is None
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage(), caplog.text
    assert "\n" not in errors[0].getMessage()
    assert not (tmp_path / "hf_model.partial").exists()
    assert sorted(path.name for path in folder.iterdir()) == before  # the previous export is untouched


def test_exporting_a_trainers_final_model_states_its_steps(exported, tmp_path):
    task = exported[0]
    trainer = tmp_path / "trainer0"
    trainer.mkdir()
    torch.save(task.model.state_dict(), trainer / "final_model.pt")
    (trainer / "summary.json").write_text(json.dumps({"global_steps": 5, "peer_name": "trainer0"}))
    rows = [{"peer": "trainer0", "step": step, "samples": 64, "loss": 8.0 - step, "metrics": {}} for step in range(5)]
    (trainer / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [f"task.{key}={value}" for key, value in vars(SMALL).items() if key != "stream" and value is not None]
    overrides = [item for item in overrides if not item.startswith(("task.betas", "task.cache_dir"))]
    result = run_script(
        "scripts/export_model.py",
        "--config",
        TINY_ALBERT,
        "--checkpoint",
        str(trainer / "final_model.pt"),
        "--output",
        str(tmp_path / "out"),
        *overrides,
        f"task.cache_dir={tmp_path / 'cache'}",
    )
    assert result.returncode == 0, result.stderr[-1500:]
    card = (tmp_path / "out" / "README.md").read_text()
    target = 256  # configs/albert/tiny.yaml's target batch: the swarm's samples are global steps x target
    for fact in ("| global steps | 5 |", f"| samples | {5 * target} |", "| training loss of global step 4 | 4.0000 |"):
        assert fact in card, fact
