"""Train the sahajBERT tokenizer (Unigram; NMT + NFKC + space collapsing + Bengali homogenisation + lowercase;
Metaspace with isolated digits and punctuation; ``[CLS] A [SEP] B [SEP]``) on a config's Bengali sources:

  python scripts/train_sahajbert_tokenizer.py --config configs/sahajbert/paper.yaml --output tokenizers/sahajbert

The output folder loads with ``transformers.AutoTokenizer.from_pretrained`` and can be given as task.tokenizer.
"""

import argparse
import logging
from pathlib import Path

from albert.sahajbert.data import BENGALI_STREAM, tokenizer_training_texts
from albert.sahajbert.tokenizer import train_bengali_tokenizer
from common.config import CONFIG_KEYS_HELP, load_config
from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import setup_logging

logger = logging.getLogger("train_sahajbert_tokenizer")


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, epilog=CONFIG_KEYS_HELP)
    parser.add_argument("--config", required=True, help="a config with task.corpus: bengali_stream")
    parser.add_argument("--output", required=True, help="folder for the tokenizer files")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. task.vocab_size=8000")
    args = parser.parse_args()
    setup_logging("tokenizer")
    config = load_config(args.config, args.overrides)
    if config.task_module != "albert" or config.task.corpus != BENGALI_STREAM:
        raise ConfigError(f"{args.config}: task.corpus must be {BENGALI_STREAM} to train the Bengali tokenizer")
    stream = config.task.stream
    logger.info(f"training on up to {stream.tokenizer_training_documents} documents of each of {stream.sources}")
    tokenizer = train_bengali_tokenizer(tokenizer_training_texts(stream), config.task.vocab_size)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.output)
    sample = "আমি বাংলায় গান গাই। ২০২১ সালে!"
    logger.info(f"saved {len(tokenizer)} tokens to {args.output}; {sample!r} -> {tokenizer.tokenize(sample)}")


if __name__ == "__main__":
    main()
