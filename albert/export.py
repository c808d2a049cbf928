"""A pretrained ALBERT leaves a run as a Hugging Face folder (``common.export``), with ALBERT's card text:
``AlbertForPreTraining.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)`` load it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.export import CardText, export_transformers_model
from common.task import ExportFacts


def albert_card(data: str) -> CardText:
    return CardText(
        title="ALBERT pretrained with masked language modelling and sentence-order prediction",
        data=data,
        pipeline_tag="fill-mask",
        usage="To fine-tune it on the offline downstream tasks: "
        "`python scripts/finetune.py --task wiki_topic --model path/to/this/folder`.",
    )


def export_albert(
    model: PreTrainedModel,
    tokenizer: Optional[PreTrainedTokenizerBase],
    folder: Path,
    facts: ExportFacts,
    data: str,
) -> Optional[Path]:
    """The folder (None if the export failed: one ERROR line, no half-written folder)."""
    return export_transformers_model(model, folder, facts, tokenizer, albert_card(data))
