"""Build the offline Bengali stand-in sources: ``python scripts/prepare_bengali_data.py``.

Needs ``apt-get update`` to have run (it calls ``apt-get download``; nothing is installed) and wordfreq.
Writes ``<output>/wikipedia_standin/ui_strings.jsonl`` and ``<output>/oscar_standin/word_lists.jsonl``.
"""

import argparse
from pathlib import Path

from albert.sahajbert.corpus import prepare_bengali_sources
from common.errors import ConfigError, exit_on_user_error
from common.lifecycle import setup_logging

DEFAULT_OUTPUT = ".cache/bengali"


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder for the two sources (git-ignored)")
    parser.add_argument(
        "--wordfreq-words",
        type=int,
        default=250_000,
        help="how many of wordfreq's most frequent Bengali words to include",
    )
    args = parser.parse_args()
    if args.wordfreq_words <= 0:
        raise ConfigError("--wordfreq-words must be > 0")
    setup_logging("prepare_bengali_data")
    prepare_bengali_sources(Path(args.output), args.wordfreq_words)


if __name__ == "__main__":
    main()
