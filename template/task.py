"""The task template: a small GPT-2-shaped causal language model on the offline Wikipedia text, trained with AdamW.

Copy this folder to start a new run (``cp -r template mytask``), set ``task_module: mytask`` in your config, and
change what your run needs. A task module gives the core two things:

* ``TaskConfig``: the config's ``task:`` section (a dataclass, validated on load: raise through ``require``);
* ``build_task(run_config, with_data=True)``: a ``common.task.Task``. Every peer builds it from the same config
  after ``torch.manual_seed(training.seed)``, so all start from the same parameters; a peer with no data to train
  on (monitor, auxiliary) passes ``with_data=False`` and must not read the corpus.

The core gives the rest: the collaborative optimizer (optimizer state is filled in before the first step for any
torch optimizer: build a plain one in ``make_optimizer``), metrics, history, reports, the live page, checkpoints,
a Hugging Face export, and the check that every peer trains the same model on the same input encoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, get_linear_schedule_with_warmup

from common.config import RunConfig, require
from common.export import CardText, export_transformers_model
from common.task import Batch, DatasetTask, ExportFacts, StepOutput
from common.text.blocks import BlockDataset, build_blocks
from common.text.cache import cache_key, load_or_build_examples
from common.text.corpus import OFFLINE_WIKIPEDIA, load_documents
from common.text.tokenizer import (
    END_OF_TEXT,
    TokenizerSpec,
    load_or_train_tokenizer,
    shared_tokenizer_folder,
    tokenizer_fingerprint,
    train_tokenizer,
)

BLOCKS_FORMAT_VERSION = 1  # bump when build_blocks changes, so cached blocks are rebuilt


@dataclass
class TaskConfig:
    corpus: str = OFFLINE_WIKIPEDIA  # offline_wikipedia | a hub name | a local .txt/.json/.jsonl/.parquet file/folder
    dataset_config: Optional[str] = None
    max_documents: Optional[int] = None
    tokenizer: str = "train"  # train (on the corpus, cached by what it was trained on) | a hub name | a local folder
    tokenizer_model: str = "bpe"  # bpe | unigram
    vocab_size: int = 4000
    block_size: int = 64  # tokens per sample: documents joined by the end-of-text token, cut into blocks
    cache_dir: str = ".cache/text"  # shared by every task: an identical tokenizer is trained once
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 2
    dropout: float = 0.0  # dropout draws from each process's own RNG: a swarm then differs from one process
    learning_rate: float = 0.003
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.01
    warmup_steps: int = 5
    total_steps: int = 100

    def __post_init__(self) -> None:
        require(self.tokenizer_model in ("bpe", "unigram"), "task.tokenizer_model must be bpe or unigram")
        require(self.vocab_size >= 300, "task.vocab_size must be >= 300 (a byte-level BPE starts from 256 bytes)")
        require(8 <= self.block_size <= 4096, "task.block_size must be in [8, 4096]")
        require(self.n_embd % self.n_head == 0, "task.n_embd must be divisible by task.n_head")
        require(0 <= self.dropout < 1, "task.dropout must be in [0, 1)")
        require(self.learning_rate > 0, "task.learning_rate must be > 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "task.betas: two values in [0, 1)")
        require(0 <= self.warmup_steps < self.total_steps, "task.total_steps must exceed task.warmup_steps >= 0")
        require(self.max_documents is None or self.max_documents > 0, "task.max_documents must be > 0")


def tokenizer_spec(config: TaskConfig) -> TokenizerSpec:
    if config.tokenizer_model == "bpe":
        return TokenizerSpec("bpe", config.vocab_size)
    specials = (END_OF_TEXT, "<unk>")
    roles = (("eos_token", END_OF_TEXT), ("pad_token", END_OF_TEXT), ("unk_token", "<unk>"))
    return TokenizerSpec("unigram", config.vocab_size, specials, roles)


def tokenizer_folder(config: TaskConfig) -> Path:
    corpus_key = (config.corpus, config.dataset_config, config.max_documents)
    return shared_tokenizer_folder(Path(config.cache_dir), corpus_key, tokenizer_spec(config))


class TemplateTask(DatasetTask):
    """``dataset`` keeps the dataset protocol (``common.text.blocks.BlockDataset`` is one): ``plan(stream_seed,
    batch_size)`` yields endless (sample ids, pass) entries; ``batch(sample_ids, pass)`` builds that micro-batch as the
    same tensors in any process (seed any randomness by sample id and pass, never by the process's RNG) and puts
    the ids under ``SAMPLE_IDS``. Worker processes then build batches ahead of training, and one process can replay
    a swarm's logged micro-batches (the contract test does). ``stream`` alone also works, in one worker, unreplayed."""

    input_mismatch_advice = "use the run's tokenizer (a copy of its folder, passed as task.tokenizer=FOLDER)"

    def __init__(self, config: TaskConfig, local_batch_size: int, dataset=None, tokenizer=None):
        self.config, self.local_batch_size, self.dataset, self.tokenizer = config, local_batch_size, dataset, tokenizer
        model_config = GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.block_size,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            resid_pdrop=config.dropout,
            embd_pdrop=config.dropout,
            attn_pdrop=config.dropout,
            bos_token_id=0,  # the end-of-text token: the tokenizer's first special token
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(model_config)

    def make_optimizer(self, params: Iterable) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.AdamW(params, lr=c.learning_rate, betas=tuple(c.betas), weight_decay=c.weight_decay)

    def make_scheduler(self, optimizer: torch.optim.Optimizer):
        """Stepped once per global step by every backend: the schedule follows the swarm, not a peer."""
        return get_linear_schedule_with_warmup(optimizer, self.config.warmup_steps, self.config.total_steps)

    def forward(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        """One micro-batch. The metric rules:

        * ``loss`` is the mean over the micro-batch; ``batch_size`` its number of samples. The core averages
          losses and metrics over micro-batches and peers weighted by samples (a global step's loss is the
          sample-weighted mean), so every metric must be a per-sample mean too: report accuracies, never counts,
          sums or ratios such as perplexity (take ``exp`` of the mean loss instead);
        * a metric named ``*_loss`` is a part of the loss: reports and the live page plot it beside the total;
          other metrics are shown as quality measures.
        """
        input_ids = batch["input_ids"]
        logits = model(input_ids=input_ids).logits[:, :-1].float()
        targets = input_ids[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with torch.no_grad():
            accuracy = (logits.argmax(-1) == targets).float().mean()
        metrics = {"next_token_accuracy": accuracy.item()}
        return StepOutput(loss=loss, batch_size=int(input_ids.shape[0]), metrics=metrics)

    def input_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)  # peers with another tokenizer are refused before averaging

    def export_pretrained(self, model: torch.nn.Module, folder: Path, facts: ExportFacts) -> Optional[Path]:
        c = self.config
        data = f"Next-token prediction on `{c.corpus}` in blocks of {c.block_size} tokens ({c.tokenizer_model})."
        card = CardText(title="a small GPT-2 causal language model", data=data, pipeline_tag="text-generation")
        tokenizer = self.tokenizer
        if tokenizer is None and (tokenizer_folder(c) / "tokenizer.json").exists():  # a monitor: the cached one
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_folder(c)))
        return export_transformers_model(model, folder, facts, tokenizer, card)


def build_task(run_config: RunConfig, with_data: bool = True) -> TemplateTask:
    config: TaskConfig = run_config.task
    if not with_data:
        return TemplateTask(config, run_config.training.local_batch_size)

    def documents() -> List[str]:
        return load_documents(config.corpus, config.dataset_config, config.max_documents)

    def train(texts: Iterable[str], _vocab_size: int) -> PreTrainedTokenizerFast:
        return train_tokenizer(texts, tokenizer_spec(config))

    folder = tokenizer_folder(config)
    tokenizer = load_or_train_tokenizer(config.tokenizer, documents, config.vocab_size, folder, train)
    require(len(tokenizer) <= config.vocab_size, f"the tokenizer has {len(tokenizer)} tokens: raise task.vocab_size")
    require(tokenizer.eos_token_id is not None, "the tokenizer has no end-of-text (eos) token")
    key = cache_key(BLOCKS_FORMAT_VERSION, config.corpus, config.dataset_config, config.max_documents)
    blocks = load_or_build_examples(
        Path(config.cache_dir) / f"blocks-{key}-{tokenizer_fingerprint(tokenizer)}-{config.block_size}.pt",
        lambda: build_blocks(documents(), tokenizer, config.block_size, tokenizer.eos_token_id),
    )
    return TemplateTask(config, run_config.training.local_batch_size, BlockDataset(blocks), tokenizer)
