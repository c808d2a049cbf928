"""A policy over state uploads: how many newcomers one peer serves its state to at once.

Installed by ``common.hivemind_patches.install`` in every peer; it limits nothing until a state averager is built
with ``max_state_uploads`` (``collaboration.max_concurrent_state_uploads``, passed by ``common/optimizer.py``).
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Optional

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from common.hivemind_patches.patcher import Patcher

logger = logging.getLogger(__name__)
TURNED_AWAY = "turned a state download away: already serving"  # the donor's one line per request it turns away
LIMIT_ATTRIBUTE = "max_state_uploads"  # the averager's limit (None: none), set before its process is forked
_SERVING_ATTRIBUTE = "_state_uploads_in_progress"


def limit_concurrent_state_uploads(patcher: Patcher, max_uploads: Optional[int] = None) -> None:
    """Let an averager serve at most ``max_state_uploads`` state downloads at once (a keyword of every
    ``DecentralizedAverager``, None: no limit); a request beyond them is answered with no data at once, which
    hivemind's download loop reads as "ask the next peer" (as for a peer that does not share its state), so
    newcomers spread over the donors instead of queueing on one. ``max_uploads``: the limit of averagers built
    without the keyword (``install`` leaves it None: they serve as hivemind does).

    Why: hivemind 1.1.12 serves every request at once. Concurrent uploads share the donor's uplink, so each stream's
    chunks come slower; on a slow uplink they come slower than ``next_chunk_timeout`` and the downloads fail
    together while the donor's own averaging traffic waits behind them (paper_results/scale, the storms with donors
    at 2 Mbit/s). Replaces ``DecentralizedAverager.__init__`` (takes the keyword, stores it before the averager's
    process is forked: the limit is counted there, where requests are served) and ``rpc_download_state`` (a
    wrapper around the original: what is sent is unchanged).

    Not a wire change, so not in ``PATCH_SET_VERSION``: a turned-away request gets the empty answer hivemind 1.1.12
    itself gives when a peer does not share its state, which every peer, with or without this patch, reads as
    "ask the next peer"; peers may choose different limits. Left out (``--without-patch``), the fingerprint names it.

    Upstream: hivemind issue #169 (open since 2021: newcomers all pick the same donor), and pull request #666
    (open) limits a peer to one state upload at a time in the same way (a busy peer returns nothing). Remove this
    when a hivemind release with such a limit is pinned, and pass its setting instead.
    """
    if max_uploads is not None and max_uploads < 1:
        raise ValueError(f"max_uploads must be >= 1 (got {max_uploads})")
    original_init = DecentralizedAverager.__init__
    original_download = DecentralizedAverager.rpc_download_state

    def __init__(self, *args, max_state_uploads: Optional[int] = None, **kwargs):
        if max_state_uploads is not None:
            if max_state_uploads < 1:
                raise ValueError(f"max_state_uploads must be >= 1 (got {max_state_uploads})")
            # set before hivemind's __init__, which forks the averager's process when it is built with start=True
            setattr(self, LIMIT_ATTRIBUTE, max_state_uploads)
        original_init(self, *args, **kwargs)

    # hivemind's own parameter names: a wrapper made with functools.wraps (tests, the fault driver) registers its
    # handler by these annotations under its own argument names
    async def rpc_download_state(
        self, _request: averaging_pb2.DownloadRequest, _context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        limit = getattr(self, LIMIT_ATTRIBUTE, None) or max_uploads
        if limit is None:
            async for message in original_download(self, _request, _context):
                yield message
            return
        serving = getattr(self, _SERVING_ATTRIBUTE, 0)
        if serving >= limit:
            logger.info(f"{TURNED_AWAY} {serving} (collaboration.max_concurrent_state_uploads={limit})")
            return  # nothing sent: the newcomer asks its next peer
        setattr(self, _SERVING_ATTRIBUTE, serving + 1)
        try:
            async for message in original_download(self, _request, _context):
                yield message
        finally:  # also when the newcomer gives up mid-stream (the generator is closed)
            setattr(self, _SERVING_ATTRIBUTE, getattr(self, _SERVING_ATTRIBUTE) - 1)

    patcher.replace(DecentralizedAverager, "__init__", __init__)
    patcher.replace(DecentralizedAverager, "rpc_download_state", rpc_download_state)


PROCESS_WIDE = (("limit_concurrent_state_uploads", limit_concurrent_state_uploads),)
