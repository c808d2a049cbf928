"""ALBERT pretraining (MLM + sentence-order prediction) as a task for the one training loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

import torch
from transformers import AlbertConfig, AlbertForPreTraining, PreTrainedTokenizerFast, get_linear_schedule_with_warmup

from albert.corpus import DOCUMENT_LAYOUTS, OFFLINE_WIKIPEDIA
from albert.data import SopDataset, build_examples, cache_key, load_or_build_example_arrays, special_ids
from albert.export import export_albert
from albert.sahajbert.data import BENGALI_STREAM, StreamConfig, bengali_tokenizer_folder, build_streaming_dataset
from albert.tokenizer import TOKENIZER_FORMAT_VERSION, load_or_train_tokenizer
from common.config import RunConfig, require
from common.errors import DataError
from common.seeding import stable_seed
from common.task import Batch, DatasetTask, ExportFacts, StepOutput
from common.text.corpus import iter_documents
from common.timm_optim import timm_optimizer

logger = logging.getLogger(__name__)

# bump when the example-building code or its stored form changes, so caches are rebuilt (4: a folder of
# memory-mapped .npy arrays, built from the corpus streamed shard by shard)
DATA_FORMAT_VERSION = 4


@dataclass
class TaskConfig:
    # data
    corpus: str = (
        OFFLINE_WIKIPEDIA  # offline_wikipedia | bengali_stream | a hub name (wikitext) | a local file or folder
    )
    stream: StreamConfig = field(default_factory=StreamConfig)  # sources mixed when corpus is bengali_stream
    dataset_config: Optional[str] = None  # e.g. wikitext-103-raw-v1
    # line: every non-empty line of a text corpus is a document | wikitext_article: WikiText lines merged into articles
    document_layout: str = "line"
    tokenizer: str = "train"  # train (Unigram on the corpus) | hub name (albert-large-v2) | local folder
    max_documents: Optional[int] = None
    # share of the documents (picked by a stable hash of their index) never trained on: the held-out evaluation
    # set (Task.heldout_batches); the tokenizer is then trained on the other documents only
    heldout_fraction: float = 0.0
    max_seq_length: int = 128
    short_seq_probability: float = 0.1
    mlm_probability: float = 0.15
    data_seed: int = 0
    cache_dir: str = ".cache/albert"
    # model (albert-large-v2 shape at paper scale)
    vocab_size: int = 8000
    embedding_size: int = 128
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    classifier_dropout_prob: float = 0.1  # albert-large-v2: dropout only in the sentence-order head
    # optimizer: LAMB (the paper)
    learning_rate: float = 0.00176
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    warmup_steps: int = 5000
    total_steps: int = 125_000

    def __post_init__(self) -> None:
        require(16 <= self.max_seq_length <= 4096, "task.max_seq_length must be in [16, 4096]")
        require(0 < self.mlm_probability < 1, "task.mlm_probability must be in (0, 1)")
        require(0 <= self.short_seq_probability <= 1, "task.short_seq_probability must be in [0, 1]")
        require(self.vocab_size >= 100, "task.vocab_size must be >= 100")
        require(
            self.document_layout in DOCUMENT_LAYOUTS,
            f"task.document_layout must be one of {', '.join(DOCUMENT_LAYOUTS)}, not {self.document_layout!r}",
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "task.hidden_size must be divisible by task.num_attention_heads",
        )
        require(self.learning_rate > 0, "task.learning_rate must be > 0")
        require(
            len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas),
            "task.betas must be two values in [0, 1)",
        )
        require(
            self.warmup_steps >= 0 and self.total_steps > self.warmup_steps,
            "task.total_steps must exceed task.warmup_steps >= 0",
        )
        require(self.max_documents is None or self.max_documents > 0, "task.max_documents must be > 0")
        require(0 <= self.heldout_fraction < 0.5, "task.heldout_fraction must be in [0, 0.5)")
        require(0 <= self.classifier_dropout_prob < 1, "task.classifier_dropout_prob must be in [0, 1)")


def build_model(config: TaskConfig, vocab_size: int) -> AlbertForPreTraining:
    model_config = AlbertConfig(
        vocab_size=vocab_size,
        embedding_size=config.embedding_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=max(512, config.max_seq_length),
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=config.classifier_dropout_prob,
    )
    return AlbertForPreTraining(model_config)


def no_decay(name: str) -> bool:
    return name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name


class AlbertTask(DatasetTask):
    input_mismatch_advice = "use the run's tokenizer (a copy of its folder, passed as task.tokenizer=FOLDER)"

    def __init__(
        self,
        config: TaskConfig,
        local_batch_size: int,
        dataset: Optional[SopDataset],
        vocab_size: int,
        tokenizer: Optional[PreTrainedTokenizerFast] = None,
    ):
        self.config, self.local_batch_size, self.dataset = config, local_batch_size, dataset
        self.tokenizer = tokenizer
        self.model = build_model(config, vocab_size)

    def input_fingerprint(self) -> str:
        if self.tokenizer is None:  # a peer without data (monitor, auxiliary) feeds the model nothing
            return ""
        return cache_key(*self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer)))))

    def export_pretrained(self, model: torch.nn.Module, folder: Path, facts: ExportFacts) -> Path:
        tokenizer = self.tokenizer if self.tokenizer is not None else cached_tokenizer(self.config)
        return export_albert(model, tokenizer, folder, facts, describe_data(self.config))

    def optimizer_param_groups(self) -> list:
        named = [(name, param) for name, param in self.model.named_parameters() if param.requires_grad]
        return [
            {
                "params": [param for name, param in named if not no_decay(name)],
                "weight_decay": self.config.weight_decay,
            },
            {"params": [param for name, param in named if no_decay(name)], "weight_decay": 0.0},
        ]

    def make_optimizer(self, params: Iterable) -> torch.optim.Optimizer:
        # timm's LAMB with always_adapt=True applies the trust ratio to every tensor like torch_optimizer.Lamb;
        # max_grad_norm clips the *averaged* gradient of the global batch (it runs inside the optimizer step).
        # Difference from the paper's torch_optimizer.Lamb: no clamp of the weight norm at 1e4 (README).
        optimizer = timm_optimizer("lamb", "Lamb")(
            params,
            lr=self.config.learning_rate,
            betas=tuple(self.config.betas),
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
            max_grad_norm=self.config.max_grad_norm,
            bias_correction=True,
            always_adapt=True,
        )
        return optimizer

    def make_scheduler(self, optimizer: torch.optim.Optimizer):
        return get_linear_schedule_with_warmup(optimizer, self.config.warmup_steps, self.config.total_steps)

    def heldout_batches(self, count: int) -> Optional[List[Batch]]:
        if self.config.heldout_fraction == 0 or self.tokenizer is None:
            return None
        dataset = build_heldout_dataset(self.config, self.tokenizer)
        size = self.local_batch_size
        if len(dataset) < count * size:
            raise DataError(
                f"the held-out documents give {len(dataset)} examples, fewer than {count} batches of {size}: "
                f"raise task.heldout_fraction or ask for fewer batches"
            )
        return [dataset.batch(range(start, start + size), 0) for start in range(0, count * size, size)]

    def forward(self, model: torch.nn.Module, batch: Batch) -> StepOutput:
        outputs = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
        )
        mlm_logits, sop_logits = outputs.prediction_logits, outputs.sop_logits
        labels = batch["labels"]
        mlm_loss = torch.nn.functional.cross_entropy(
            mlm_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100
        )
        sop_loss = torch.nn.functional.cross_entropy(sop_logits.float(), batch["sentence_order_label"])
        with torch.no_grad():
            masked = labels != -100
            mlm_accuracy = (mlm_logits.argmax(-1)[masked] == labels[masked]).float().mean()
            sop_accuracy = (sop_logits.argmax(-1) == batch["sentence_order_label"]).float().mean()
        return StepOutput(
            loss=mlm_loss + sop_loss,
            batch_size=int(labels.shape[0]),
            metrics={
                "mlm_loss": mlm_loss.item(),
                "sop_loss": sop_loss.item(),
                "mlm_accuracy": mlm_accuracy.item(),
                "sop_accuracy": sop_accuracy.item(),
            },
        )


def _tokenizer_key(config: TaskConfig) -> str:
    return cache_key(
        TOKENIZER_FORMAT_VERSION,
        config.corpus,
        config.dataset_config,
        config.max_documents,
        config.vocab_size,
        config.heldout_fraction,
        *([config.document_layout] if config.document_layout != "line" else []),
    )


def tokenizer_folder(config: TaskConfig) -> Path:
    """Where a tokenizer trained on the corpus is cached (its name hashes what it was trained on)."""
    if config.corpus == BENGALI_STREAM:
        return bengali_tokenizer_folder(config)
    return Path(config.cache_dir) / f"tokenizer-{_tokenizer_key(config)}"


def is_heldout(index: int, fraction: float) -> bool:
    """A document is held out by a stable hash of its index, so the split does not depend on the corpus order's
    topics and every peer makes the same one."""
    return stable_seed("heldout", index) % 10_000 < fraction * 10_000


def split_heldout(documents: List[str], fraction: float) -> Tuple[List[str], List[str]]:
    """(training, held-out) documents (see :func:`is_heldout`)."""
    held = [is_heldout(index, fraction) for index in range(len(documents))]
    return [doc for doc, out in zip(documents, held) if not out], [doc for doc, out in zip(documents, held) if out]


def corpus_part(config: TaskConfig, part: str) -> Iterator[str]:
    """The training (``train``) or held-out (``heldout``) documents of the corpus, streamed."""
    documents = iter_documents(config.corpus, config.dataset_config, config.max_documents, config.document_layout)
    if not config.heldout_fraction:
        return documents if part == "train" else iter(())
    wanted = part == "heldout"
    return (doc for index, doc in enumerate(documents) if is_heldout(index, config.heldout_fraction) == wanted)


def examples_folder(config: TaskConfig, part: str) -> Path:
    return Path(config.cache_dir) / f"examples-{_examples_key(config, part)}"


def cached_examples(config: TaskConfig, tokenizer, part: str) -> Tuple[dict, Path]:
    """The SOP example arrays of a part of the corpus, built once (streamed, in parallel) and read memory-mapped."""
    folder = examples_folder(config, part)
    examples = load_or_build_example_arrays(
        folder,
        lambda target: build_examples(
            lambda: corpus_part(config, part),
            tokenizer,
            config.max_seq_length,
            config.short_seq_probability,
            config.data_seed,
            folder=target,
        ),
    )
    return examples, folder


def _examples_key(config: TaskConfig, part: str) -> str:
    return cache_key(
        DATA_FORMAT_VERSION,
        _tokenizer_key(config),
        config.tokenizer,
        config.max_seq_length,
        config.short_seq_probability,
        config.data_seed,
        *([part] if part != "train" else []),
    )


def build_heldout_dataset(config: TaskConfig, tokenizer) -> SopDataset:
    """SOP examples of the held-out documents (cached), masked like training data with their own seed."""
    examples, folder = cached_examples(config, tokenizer, "heldout")
    return SopDataset(
        examples,
        special_ids(tokenizer),
        config.mlm_probability,
        stable_seed(config.data_seed, "heldout"),
        config.max_seq_length,
        folder,
    )


def cached_tokenizer(config: TaskConfig) -> Optional[PreTrainedTokenizerFast]:
    """The run's tokenizer without building any data: a peer without data (the monitor) exports it beside the
    weights when this machine has it (the trained one in the cache, or a local folder named by task.tokenizer)."""
    if config.tokenizer != "train":
        return PreTrainedTokenizerFast.from_pretrained(config.tokenizer) if Path(config.tokenizer).is_dir() else None
    folder = tokenizer_folder(config)
    return PreTrainedTokenizerFast.from_pretrained(str(folder)) if (folder / "tokenizer.json").exists() else None


def describe_data(config: TaskConfig) -> str:
    """The model card's training-data paragraph."""
    if config.corpus == OFFLINE_WIKIPEDIA:
        source = "the offline English Wikipedia corpus shipped with the environment (article lead sections)"
    elif config.corpus == BENGALI_STREAM:
        source = f"a streamed mix of Bengali sources ({', '.join(config.stream.sources)})"
    else:
        source = f"`{config.corpus}`" + (f" ({config.dataset_config})" if config.dataset_config else "")
    limit = f", first {config.max_documents} documents" if config.max_documents else ""
    return (
        f"Masked language modelling ({config.mlm_probability:.0%} of tokens) and sentence-order prediction on "
        f"{source}{limit}, in segment pairs of {config.max_seq_length} tokens; tokenizer: "
        f"{'a Unigram model trained on the corpus' if config.tokenizer == 'train' else config.tokenizer}."
    )


def build_dataset(config: TaskConfig):
    """Tokenizer + cached SOP examples for the configured corpus (or the streamed sahajBERT mix)."""
    if config.corpus == BENGALI_STREAM:
        return build_streaming_dataset(config)
    # the tokenizer is trained (once, then cached) on the streamed training documents
    tokenizer = load_or_train_tokenizer(
        config.tokenizer, lambda: corpus_part(config, "train"), config.vocab_size, tokenizer_folder(config)
    )
    examples, folder = cached_examples(config, tokenizer, "train")
    logger.info(f"ALBERT data: {len(examples['offsets']) - 1} SOP examples of up to {config.max_seq_length} tokens")
    return tokenizer, SopDataset(
        examples, special_ids(tokenizer), config.mlm_probability, config.data_seed, config.max_seq_length, folder
    )


def build_task(run_config: RunConfig, with_data: bool = True) -> AlbertTask:
    config: TaskConfig = run_config.task
    if not with_data:
        return AlbertTask(config, run_config.training.local_batch_size, None, config.vocab_size)
    tokenizer, dataset = build_dataset(config)
    if len(tokenizer) > config.vocab_size:  # every peer must build the same model, so the size comes from config
        raise DataError(f"tokenizer has {len(tokenizer)} tokens but task.vocab_size is {config.vocab_size}")
    return AlbertTask(config, run_config.training.local_batch_size, dataset, config.vocab_size, tokenizer)
