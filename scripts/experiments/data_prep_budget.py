"""What a volunteer pays before contributing to the paper's ALBERT run: building the sentence-order examples of a
large corpus (time and peak memory of the whole process tree), measured on a corpus made of the offline Wikipedia
lead sections repeated ``--copies`` times (WikiText-103 is not available offline), one document per line.

The tokenizer (a 30,000-piece Unigram model, as albert-large-v2 has) is trained once and handed to every run, so
the figures are example building alone; ``--checkout`` measures another checkout's code on the same corpus (e.g. a
``git worktree`` of an earlier commit), which gives a before/after comparison.

    python scripts/experiments/data_prep_budget.py --copies 4 --out paper_results/fullscale/data_prep_after.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil
import torch

from common.errors import exit_on_user_error
from common.lifecycle import setup_logging
from common.tools.provenance import ROOT, git_commit, load_average, machine_description

logger = logging.getLogger("data_prep_budget")

CHILD = """
import sys
from common.config import load_config, import_task_module
config = load_config(sys.argv[1], sys.argv[2:])
import_task_module(config.task_module).build_task(config)
"""


def write_corpus(path: Path, copies: int) -> int:
    """The offline Wikipedia leads, one per line, ``copies`` times; returns the number of words."""
    from common.text.corpus import offline_wikipedia_articles

    documents = [" ".join(article["text"].split()) for article in offline_wikipedia_articles()]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        with temporary.open("w") as stream:
            for _ in range(copies):
                stream.writelines(document + "\n" for document in documents)
        temporary.replace(path)
    return copies * sum(len(document.split()) for document in documents)


def trained_tokenizer(folder: Path, vocab_size: int) -> Path:
    if not (folder / "tokenizer.json").exists():
        from albert.tokenizer import train_unigram_tokenizer
        from common.text.corpus import OFFLINE_WIKIPEDIA, load_documents

        logger.info(f"training a {vocab_size}-piece Unigram tokenizer once (shared by every run)")
        train_unigram_tokenizer(load_documents(OFFLINE_WIKIPEDIA, None, None), vocab_size).save_pretrained(folder)
    return folder


def tree_memory(process: psutil.Process) -> tuple:
    """(RSS summed, PSS summed) over the process and its workers, in bytes. RSS counts the pages they share (the
    libraries every spawned worker maps) once per process; PSS splits them, so its sum is what the tree uses."""
    rss = pss = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            rss += member.memory_info().rss
            pss += member.memory_full_info().pss
        except psutil.Error:
            continue
    return rss, pss


def measure(checkout: Path, overrides: list, cache_dir: Path, log: Path) -> dict:
    """Build the examples in a child process running ``checkout``'s code; sample its process tree's memory."""
    environment = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-c", CHILD, str(checkout / "configs/albert/paper.yaml"), *overrides]
    started, peak, peak_pss, samples = time.monotonic(), 0, 0, 0
    with log.open("wb") as stream:
        child = subprocess.Popen(command, cwd=checkout, env=environment, stdout=stream, stderr=subprocess.STDOUT)
        watched = psutil.Process(child.pid)
        while child.poll() is None:
            rss, pss = tree_memory(watched)
            peak, peak_pss = max(peak, rss), max(peak_pss, pss)
            samples += 1
            if samples % 120 == 0:
                logger.info(
                    f"building: {time.monotonic() - started:.0f} s, peak so far {peak / 2**20:.0f} MiB RSS, "
                    f"{peak_pss / 2**20:.0f} MiB PSS"
                )
            time.sleep(0.5)
    seconds = time.monotonic() - started
    if child.returncode != 0:
        raise RuntimeError(f"the build failed (exit {child.returncode}): see {log}")
    (cache,) = [path for path in cache_dir.glob("examples-*") if not path.name.endswith(".tmp")]
    if cache.is_dir():  # since DATA_FORMAT_VERSION 4: a folder of .npy arrays, read memory-mapped
        facts = json.loads((cache / "examples.json").read_text())
        count, tokens, stored = facts["examples"], facts["tokens"], "unpadded token ids, .npy arrays (memory-mapped)"
        size = sum(path.stat().st_size for path in cache.iterdir())
    else:
        examples = torch.load(cache, weights_only=True)
        unpadded = "tokens" in examples  # the stored format since 26aa986; padded 512-token rows before
        count = len(examples["sentence_order_label"])
        tokens = len(examples["tokens"]) if unpadded else int(examples["attention_mask"].long().sum())
        stored, size = "unpadded token ids" if unpadded else "padded rows", cache.stat().st_size
    return {
        "seconds": round(seconds, 1),
        "peak_tree_rss_mib": round(peak / 2**20),
        "peak_tree_pss_mib": round(peak_pss / 2**20),
        "examples": count,
        "example_tokens": tokens,
        "stored_as": stored,
        "cache_mib": round(size / 2**20, 1),
    }


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=4, help="times the offline Wikipedia leads are repeated")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the code to measure (default: this checkout)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before, after)")
    parser.add_argument("--work", type=Path, default=Path("outputs/data_prep"), help="corpus, tokenizer, caches")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args()
    setup_logging("data_prep_budget")
    work = args.work.resolve()
    corpus = work / f"wikipedia_leads_x{args.copies}.txt"
    words = write_corpus(corpus, args.copies)
    tokenizer = trained_tokenizer(work / "tokenizer_30000", 30000)
    cache_dir = work / f"cache_{args.label or 'run'}_x{args.copies}"
    for old in cache_dir.glob("examples-*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    checkout = args.checkout.resolve()
    overrides = [f"task.corpus={corpus}", f"task.tokenizer={tokenizer}", f"task.cache_dir={cache_dir}"]
    logger.info(f"building the examples of {words:,} words with {checkout} (load average {load_average()})")
    load_before = load_average()
    result = measure(checkout, overrides, cache_dir, work / f"{args.label or 'run'}_x{args.copies}.log")
    record = {
        "what": "sentence-order examples of configs/albert/paper.yaml (seq 512) built from a corpus file, the "
        "tokenizer given: wall seconds and the peak memory of the building process and its workers, sampled every "
        "0.5 s (RSS summed over the processes, and PSS summed, which counts their shared pages once)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "label": args.label,
        "code": git_commit() if checkout == ROOT else f"{checkout} (another checkout)",
        "corpus": f"offline Wikipedia lead sections x {args.copies}, one per line: {words:,} words",
        "words": words,
        **result,
        "machine": machine_description(),
        "load_average_before_after": [load_before, load_average()],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    logger.info(
        f"{result['examples']:,} examples ({result['example_tokens']:,} tokens) in {result['seconds']:.0f} s, "
        f"peak {result['peak_tree_rss_mib']:,} MiB RSS, {result['peak_tree_pss_mib']:,} MiB PSS: {args.out}"
    )


if __name__ == "__main__":
    main()
