"""Offline Bengali material written as two local sources in the hub schema (JSON lines, ``text``).

NOT a pretraining corpus: there is no running Bengali text that installs offline. The two stand-ins are
  * ``wikipedia_standin``: ~10k real Bengali sentences and phrases, the translated user-interface strings of
    LibreOffice and Firefox (Debian ``libreoffice-l10n-bn``, ``firefox-esr-l10n-bn``), one string per line,
    grouped by the program component they come from (stands in for Wikipedia-bn, the 0.23 share);
  * ``oscar_standin``: Bengali word lists, wordfreq's frequency-ranked list and the hunspell ``bn_BD``
    dictionary, in their own order, a fixed number of words per line (stands in for OSCAR-bn, the 0.77 share).
They exercise the tokenizer, the streaming mixer and the MLM pipeline end to end on real Bengali strings.
"""

from __future__ import annotations

import gettext
import json
import logging
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

from common.errors import DataError

logger = logging.getLogger(__name__)

DEBIAN_PACKAGES = ("hunspell-bn", "firefox-esr-l10n-bn", "libreoffice-l10n-bn")
WIKIPEDIA_STANDIN, OSCAR_STANDIN = "wikipedia_standin", "oscar_standin"
STRINGS_PER_DOCUMENT = 16
WORDS_PER_LINE, LINES_PER_DOCUMENT = 12, 8
BENGALI_LETTER = re.compile(r"[\u0980-\u09ff]")
MARKUP = re.compile(r"<[^>]+>|\{[^{}]*\}|%\d*\$?[sdS]|\$\([A-Z0-9_]+\)|%[A-Z0-9_]+%?")


def extract_debian_packages(packages: Sequence[str], destination: Path) -> Path:
    """``apt-get download`` + ``dpkg-deb -x`` into ``destination`` (no installation, no root needed)."""
    destination.mkdir(parents=True, exist_ok=True)
    root = destination / "root"
    with tempfile.TemporaryDirectory() as download_dir:
        result = subprocess.run(["apt-get", "download", *packages], cwd=download_dir, capture_output=True, text=True)
        if result.returncode != 0:
            detail = " ".join(result.stderr.split())[:300]
            raise DataError(f"apt-get download {' '.join(packages)} failed ({detail}); run `apt-get update` first")
        for deb in sorted(Path(download_dir).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def clean_ui_string(text: str) -> str:
    """Drop accelerator marks (``~``, ``&``), HTML tags and format placeholders; collapse whitespace."""
    text = MARKUP.sub(" ", text.replace("~", "").replace("&", ""))
    return " ".join(text.split())


def _mo_strings(path: Path) -> List[str]:
    with path.open("rb") as handle:
        catalog = gettext.GNUTranslations(handle)._catalog  # the parsed msgid -> msgstr table
    values: List[str] = []
    for msgid, msgstr in catalog.items():
        if msgid == "":  # the header entry
            continue
        values.extend(msgstr if isinstance(msgstr, (list, tuple)) else [msgstr])
    return values


def _key_value_strings(text: str, separator: str) -> List[str]:
    """Values of ``key = value`` lines (Fluent .ftl and Java .properties files)."""
    values = []
    for line in text.splitlines():
        if line.lstrip().startswith(("#", "!")) or separator not in line:
            continue
        values.append(line.split(separator, 1)[1])
    return values


def ui_strings(root: Path) -> Iterator[Tuple[str, str]]:
    """(component, cleaned Bengali string) from the extracted LibreOffice .mo and Firefox langpack files."""
    for path in sorted(root.rglob("*.mo")):
        for value in _mo_strings(path):
            yield path.stem, value
    for xpi in sorted(root.rglob("*.xpi")):
        with zipfile.ZipFile(xpi) as archive:
            for name in sorted(archive.namelist()):
                if name.endswith((".ftl", ".properties")):
                    separator = " = " if name.endswith(".ftl") else "="
                    for value in _key_value_strings(archive.read(name).decode("utf-8", "replace"), separator):
                        yield Path(name).stem, value


def ui_string_documents(root: Path) -> List[str]:
    by_component: Dict[str, List[str]] = {}
    seen = set()
    for component, raw in ui_strings(root):
        text = clean_ui_string(raw)
        if len(BENGALI_LETTER.findall(text)) >= 2 and text not in seen:
            seen.add(text)
            by_component.setdefault(component, []).append(text)
    documents = []
    for component in sorted(by_component):
        strings = by_component[component]
        for start in range(0, len(strings), STRINGS_PER_DOCUMENT):
            documents.append("\n".join(strings[start : start + STRINGS_PER_DOCUMENT]))
    return documents


def hunspell_words(dic_path: Path) -> List[str]:
    lines = dic_path.read_text(encoding="utf-8", errors="replace").splitlines()[1:]  # first line: entry count
    return [line.split("/", 1)[0].strip() for line in lines if BENGALI_LETTER.search(line)]


def word_list_documents(words: Sequence[str]) -> List[str]:
    lines = [" ".join(words[start : start + WORDS_PER_LINE]) for start in range(0, len(words), WORDS_PER_LINE)]
    return ["\n".join(lines[start : start + LINES_PER_DOCUMENT]) for start in range(0, len(lines), LINES_PER_DOCUMENT)]


def write_jsonl(documents: Sequence[str], path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for index, text in enumerate(documents):
            handle.write(json.dumps({"id": f"{source}-{index}", "text": text}, ensure_ascii=False) + "\n")
    temporary.replace(path)


def prepare_bengali_sources(output_dir: Path, wordfreq_words: int) -> Dict[str, int]:
    """Write both stand-in sources under ``output_dir``; returns documents written per source."""
    from wordfreq import top_n_list

    root = extract_debian_packages(DEBIAN_PACKAGES, output_dir / "debian")
    dictionaries = list(root.rglob("bn_BD.dic"))
    if not dictionaries:
        raise DataError(f"hunspell-bn did not contain bn_BD.dic under {root}")
    ui_documents = ui_string_documents(root)
    words = list(top_n_list("bn", wordfreq_words, wordlist="large")) + hunspell_words(dictionaries[0])
    word_documents = word_list_documents(words)
    write_jsonl(ui_documents, output_dir / WIKIPEDIA_STANDIN / "ui_strings.jsonl", WIKIPEDIA_STANDIN)
    write_jsonl(word_documents, output_dir / OSCAR_STANDIN / "word_lists.jsonl", OSCAR_STANDIN)
    counts = {WIKIPEDIA_STANDIN: len(ui_documents), OSCAR_STANDIN: len(word_documents)}
    logger.info(f"Bengali stand-in sources under {output_dir}: {counts} documents ({len(words)} words in word lists)")
    return counts
