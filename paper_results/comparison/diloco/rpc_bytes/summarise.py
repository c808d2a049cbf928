"""Adds up what ``sitecustomize.py`` counted: protobuf bytes each peer sent, per RPC, over all its processes.

    .venv/bin/python paper_results/comparison/diloco/rpc_bytes/summarise.py RPC_BYTES_DIR OUTPUT.json

A peer is named by its ``training.output_dir`` override (its folder under the swarm's output). ``find:<key>`` rows
split the ``resp:DHTProtocol.rpc_find`` row by key; the total leaves them out.
"""

import collections
import json
import sys
from pathlib import Path


def main() -> None:
    counts, output = Path(sys.argv[1]), Path(sys.argv[2])
    by_peer = collections.defaultdict(collections.Counter)
    for path in sorted(counts.glob("*.json")):
        record = json.loads(path.read_text())
        folders = [arg.split("=", 1)[1] for arg in record["argv"] if arg.startswith("training.output_dir=")]
        peer = Path(folders[-1]).name if folders else "launcher"
        for name, (sent, _) in record["sent"].items():
            by_peer[peer][name] += sent
    summary = {peer: dict(counter.most_common()) for peer, counter in sorted(by_peer.items())}
    output.write_text(json.dumps(summary, indent=1) + "\n")
    for peer, counter in summary.items():
        total = sum(sent for name, sent in counter.items() if not name.startswith("find:"))
        top = ", ".join(f"{name} {sent / 1e6:.2f}" for name, sent in list(counter.items())[:6])
        print(f"{peer}: {total / 1e6:.2f} MB ({top})")


if __name__ == "__main__":
    main()
