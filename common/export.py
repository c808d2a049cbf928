"""Any ``transformers`` model leaves a run as a Hugging Face folder: ``config.json``, ``model.safetensors``, the
tokenizer files and a model card (``README.md``), loadable with ``from_pretrained`` and pushable as it is.

Tasks change only what differs through :class:`CardText` (title, training data, how to use it). The card states
the facts of the weights it was written from (:func:`facts_at_step`): the loss of the last step those weights were
updated with, never a later one."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from torch import nn

from common.errors import PeerError
from common.task import ExportFacts

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
# model config fields worth a line on the card, under the names the common model families use
SHAPE_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "hidden_size",
    "n_embd",
    "embedding_size",
    "num_attention_heads",
    "n_head",
    "intermediate_size",
    "n_inner",
    "max_position_embeddings",
    "n_positions",
    "vocab_size",
)


@dataclass
class CardText:
    """What a task says on its model card besides the facts: what the weights are, what they were trained on, the
    hub's pipeline tag and anything to add after the loading snippet."""

    title: str = "a model pretrained collaboratively"
    data: str = "Not described by the task."
    pipeline_tag: Optional[str] = None
    usage: str = ""
    tags: tuple = ()


def facts_at_step(
    rows: Iterable[dict],
    step: int,
    *,
    run_id: str,
    exported_by: str,
    backend: str,
    samples_per_step: Optional[int] = None,
) -> ExportFacts:
    """The facts of weights that have been through ``step`` global steps, from the per-step rows a run recorded (a
    monitor's or single process's ``history.jsonl``, a trainer's ``steps.jsonl``): the loss and metrics of step
    ``step - 1``, the last the weights were updated with, or where the history has not reached it yet (a monitor
    aggregates a step after the swarm took it) those of the last step recorded, named as such; the samples and
    contributors of the steps before ``step``. Rows of later steps (the history runs ahead of an older checkpoint)
    are ignored. When steps are missing, ``samples`` is ``step * samples_per_step`` if given."""
    recorded = {int(row["step"]): row for row in rows if 0 <= int(row["step"]) < step}
    last = recorded[max(recorded)] if recorded else None
    contributors: dict = {}
    for row in recorded.values():
        shares = row.get("contributions") or ({row["peer"]: row.get("samples", 0)} if "peer" in row else {})
        for peer, samples in shares.items():
            name = row.get("names", {}).get(peer, peer)
            entry = contributors.setdefault(peer, {"peer": name, "samples": 0, "steps": 0})
            entry["samples"] += int(samples)
            entry["steps"] += 1
    samples = sum(int(row.get("samples", 0)) for row in recorded.values())
    if len(recorded) < step and samples_per_step is not None:
        samples = step * samples_per_step
    return ExportFacts(
        run_id=run_id,
        global_step=step,
        samples=samples,
        exported_by=exported_by,
        backend=backend,
        final_loss=last["loss"] if last is not None else None,
        loss_step=int(last["step"]) if last is not None else None,
        metrics=dict(last.get("metrics", {})) if last is not None else {},
        contributors=sorted(contributors.values(), key=lambda row: -row["samples"]),
    )


def _shape_lines(model: nn.Module) -> str:
    config = model.config
    rows = [f"| {name} | {getattr(config, name)} |\n" for name in SHAPE_FIELDS if getattr(config, name, None)]
    parameters = sum(param.numel() for param in model.parameters())
    return "| | |\n|---|---|\n" + "".join(rows) + f"| parameters | {parameters:,} |\n"


def _contributor_lines(contributors: List[dict]) -> str:
    if not contributors:
        return "No per-peer record was available where this folder was written.\n"
    rows = "".join(
        f"| {row['peer']} | {row['samples']} | {row.get('steps', '')} |\n"
        for row in sorted(contributors, key=lambda row: -int(row["samples"]))
    )
    return "| peer | samples | global steps |\n|---|---|---|\n" + rows


def model_card(model: nn.Module, facts: ExportFacts, card: CardText, has_tokenizer: bool) -> str:
    """The card: what the weights are, what they were trained on and for how long, by whom, and how to load them."""
    model_class = type(model).__name__
    last_update = facts.global_step - 1
    loss_step = last_update if facts.loss_step is None else facts.loss_step
    loss = "not recorded" if facts.final_loss is None else f"{facts.final_loss:.4f}"
    if loss_step != last_update:  # say so: it is not the loss of the step these weights come from
        loss += f" (step {last_update}, these weights' last update, was not yet recorded when this was written)"
    metrics = "".join(f"| {name} | {value:.4f} |\n" for name, value in sorted(facts.metrics.items()))
    tags = "".join(f"- {tag}\n" for tag in (getattr(model.config, "model_type", None), *card.tags) if tag)
    pipeline = f"pipeline_tag: {card.pipeline_tag}\n" if card.pipeline_tag else ""
    load_tokenizer = "tokenizer = AutoTokenizer.from_pretrained(folder)\n" if has_tokenizer else ""
    tokenizer_note = (
        "The tokenizer the run trained (or loaded) is in this folder."
        if has_tokenizer
        else "The tokenizer was not available where this folder was written: load it from the training run."
    )
    return f"""---
library_name: transformers
{pipeline}tags:
{tags}- collaborative-training
- hivemind
---

# {facts.run_id}: {card.title}

Trained by a DeDLOC-style collaboration (hivemind peers averaging gradients each global step) or one of its
baselines; this folder was written by {facts.exported_by}.

## Model

`{model_class}`:

{_shape_lines(model)}
## Training data

{card.data}

## Training

These are the facts of the weights in this folder: their loss is that of the last global step they were
updated with.

| | |
|---|---|
| training backend | {facts.backend} |
| global steps | {facts.global_step} |
| samples | {facts.samples} |
| training loss of global step {loss_step} | {loss} |
{metrics}
### Contributors

{_contributor_lines(facts.contributors)}
## How to load it

```python
from transformers import AutoTokenizer, {model_class}

folder = "path/to/this/folder"  # or the hub repository it was pushed to
model = {model_class}.from_pretrained(folder)
{load_tokenizer}```

{tokenizer_note} {card.usage}

## Limitations

A small model trained on a small corpus for few steps: a demonstration of collaborative pretraining, not a
general-purpose model.
"""


def export_transformers_model(
    model: nn.Module,
    folder: Path,
    facts: ExportFacts,
    tokenizer=None,
    card: Optional[CardText] = None,
    raise_errors: bool = False,
) -> Optional[Path]:
    """Write ``model`` (a ``transformers.PreTrainedModel``) with ``tokenizer`` and its card to ``folder``; return
    the folder, or None for a model of another kind (no such format).

    The folder is written beside its final place, then swapped in, so a reader never sees half of it (the monitor
    rewrites the same folder at every checkpoint). An export that fails leaves the previous folder and no
    ``.partial`` one, and is one ERROR line, so a monitor exporting at every checkpoint keeps running; with
    ``raise_errors`` (a script the user runs for this export) it raises ``PeerError`` instead."""
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        return None
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(str(staging), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        (staging / CARD_FILE).write_text(model_card(model, facts, card or CardText(), tokenizer is not None))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    except Exception as error:  # disk full, a model save_pretrained cannot serialise, a card field it lacks ...
        shutil.rmtree(staging, ignore_errors=True)
        message = (
            f"could not export the model of global step {facts.global_step} to {folder}: "
            + " ".join(f"{type(error).__name__}: {error}".split())[:300]
        )
        if raise_errors:
            raise PeerError(message) from None
        logger.error(message)
        return None
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
