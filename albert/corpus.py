"""ALBERT reads the shared text corpora (``common.text.corpus``); these names stay importable from here."""

from common.text.corpus import (  # noqa: F401
    DOCUMENT_LAYOUTS,
    OFFLINE_WIKIPEDIA,
    load_documents,
    load_hub_dataset,
    load_hub_or_local_text,
    offline_wikipedia_articles,
    wikitext_documents,
)
