"""A pretrained ALBERT leaves a run as a Hugging Face folder: ``config.json``, ``model.safetensors``, the
tokenizer files and a model card (``README.md``), so ``AlbertForPreTraining.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)`` load it, and the folder can be pushed to the hub as it is."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.errors import PeerError
from common.task import ExportFacts

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"


def _metric_lines(facts: ExportFacts) -> str:
    if not facts.metrics:
        return ""
    return "".join(f"| {name} | {value:.4f} |\n" for name, value in sorted(facts.metrics.items()))


def _contributor_lines(facts: ExportFacts) -> str:
    if not facts.contributors:
        return "No per-peer record was available where this folder was written.\n"
    rows = "".join(
        f"| {row['peer']} | {row['samples']} | {row.get('steps', '')} |\n"
        for row in sorted(facts.contributors, key=lambda row: -int(row["samples"]))
    )
    return "| peer | samples | global steps |\n|---|---|---|\n" + rows


def model_card(model: PreTrainedModel, facts: ExportFacts, data: str, has_tokenizer: bool) -> str:
    """The card: what the weights are, what they were trained on and for how long, by whom, and how to load them."""
    config = model.config
    loss = f"{facts.final_loss:.4f}" if facts.final_loss is not None else "not recorded"
    tokenizer_note = (
        "The tokenizer the run trained (or loaded) is in this folder."
        if has_tokenizer
        else "The tokenizer was not available where this folder was written: load it from the training run."
    )
    load_tokenizer = "tokenizer = AutoTokenizer.from_pretrained(folder)\n" if has_tokenizer else ""
    return f"""---
library_name: transformers
pipeline_tag: fill-mask
tags:
- albert
- collaborative-training
- hivemind
---

# {facts.run_id}: ALBERT pretrained with masked language modelling and sentence-order prediction

Trained by a DeDLOC-style collaboration (hivemind peers averaging gradients each global step) or one of its
baselines; this folder was written by {facts.exported_by}.

## Model

ALBERT (`AlbertForPreTraining`, layers share their weights): {config.num_hidden_layers} layers, hidden size
{config.hidden_size}, embedding size {config.embedding_size}, {config.num_attention_heads} attention heads,
feed-forward size {config.intermediate_size}, vocabulary {config.vocab_size} tokens,
{sum(param.numel() for param in model.parameters()):,} parameters.

## Training data

{data}

## Training

| | |
|---|---|
| training backend | {facts.backend} |
| global steps | {facts.global_step} |
| samples | {facts.samples} |
| training loss of the last recorded step (MLM + SOP) | {loss} |
{_metric_lines(facts)}
### Contributors

{_contributor_lines(facts)}
## How to load it

```python
from transformers import AlbertForPreTraining, AutoTokenizer

folder = "path/to/this/folder"  # or the hub repository it was pushed to
model = AlbertForPreTraining.from_pretrained(folder)
{load_tokenizer}```

{tokenizer_note} To fine-tune it on the offline downstream tasks:
`python scripts/finetune.py --task wiki_topic --model path/to/this/folder`.

## Limitations

A small model trained on a small corpus for few steps: a demonstration of collaborative pretraining, not a
general-purpose language model.
"""


def export_albert(
    model: PreTrainedModel,
    tokenizer: Optional[PreTrainedTokenizerBase],
    folder: Path,
    facts: ExportFacts,
    data: str,
) -> Path:
    """Write the folder next to its final place, then swap it in, so a reader never sees half a folder for long
    (the monitor rewrites the same folder at every checkpoint)."""
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(staging))
    (staging / CARD_FILE).write_text(model_card(model, facts, data, tokenizer is not None))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    logger.info(f"exported the model (global step {facts.global_step}) as a Hugging Face folder: {folder}")
    return folder


def push_to_hub(folder: Path, repo: str) -> str:
    """Upload an exported folder to a hub model repository (created if missing); a hub that cannot be reached
    or refuses the upload is one clear error, not a traceback."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, repo_type="model", exist_ok=True)
        return str(api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model").commit_url)
    except Exception as error:
        detail = " ".join(str(error).split())[:200]
        raise PeerError(f"cannot push {folder} to the hub repository {repo!r}: {detail}") from None
