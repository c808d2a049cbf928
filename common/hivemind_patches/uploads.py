"""A policy over state uploads: how many newcomers one peer serves its state to at once.

Not among ``install``'s patches: it takes a limit, which a run chooses (for now only the benchmark shim of
``scripts/experiments/scale_swarm.py --max-state-uploads`` applies it; a run config would need a key for it).
"""

from __future__ import annotations

from typing import AsyncIterator

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from common.hivemind_patches.patcher import Patcher


def limit_concurrent_state_uploads(patcher: Patcher, max_uploads: int) -> None:
    """Serve at most ``max_uploads`` state downloads at once from each averager; a request beyond them is answered
    with no data at once, which hivemind's download loop reads as "ask the next peer" (as for a peer that does not
    share its state), so newcomers spread over the donors instead of queueing on one.

    Why: hivemind 1.1.12 serves every request at once (hivemind issue #169). Concurrent uploads share the donor's
    uplink, so each stream's chunks come slower; on a slow uplink they come slower than ``next_chunk_timeout`` and
    every download fails together (paper_results/scale, the storm with donors at 2 Mbit/s), while the donor's own
    averaging traffic waits behind them. Replaces ``DecentralizedAverager.rpc_download_state`` (a wrapper around the
    original: what is sent is unchanged); the averagers of a peer are forked after this runs and inherit it.

    Upstream: learning-at-home/hivemind pull request #666 (open) limits a peer to one state upload at a time in the
    same way (a busy peer returns nothing). Remove this when a hivemind release with such a limit is pinned.
    """
    if max_uploads < 1:
        raise ValueError(f"max_uploads must be >= 1 (got {max_uploads})")
    original = DecentralizedAverager.rpc_download_state

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        serving = getattr(self, "_state_uploads_in_progress", 0)
        if serving >= max_uploads:
            return  # nothing sent: the newcomer asks its next peer
        self._state_uploads_in_progress = serving + 1
        try:
            async for message in original(self, request, context):
                yield message
        finally:  # also when the newcomer gives up mid-stream (the generator is closed)
            self._state_uploads_in_progress -= 1

    patcher.replace(DecentralizedAverager, "rpc_download_state", rpc_download_state)
