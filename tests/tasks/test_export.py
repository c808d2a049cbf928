"""A trained ALBERT leaves a run as a Hugging Face folder that the ecosystem's loaders accept as it is."""

import json

import pytest
import torch
from transformers import AlbertForPreTraining, AutoTokenizer

from albert.corpus import OFFLINE_WIKIPEDIA, load_documents
from albert.task import AlbertTask
from albert.tokenizer import train_unigram_tokenizer
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
