"""Benchmark-only hivemind settings that our run config has no key for, from the environment.

``scale_swarm.py`` puts this folder on its peers' PYTHONPATH for two trials of issue 43; without the variables below
it does nothing.

* DEDLOC_TARGET_GROUP_SIZE=N (``--target-group-size``): hivemind's ``target_group_size`` for every averager.
  hivemind 1.1.12's Optimizer takes no such argument (only its averagers do), so this sets the averagers' default;
  a run config that wants a cap needs a ``collaboration.target_group_size`` handed to both averagers in
  common/optimizer.py, and then this part goes.
* DEDLOC_MAX_STATE_UPLOADS=N (``--max-state-uploads``): each averager serves at most N state downloads at once
  (``common.hivemind_patches.uploads.limit_concurrent_state_uploads``); a run config would need a key for it.
"""

import os

_SIZE = os.environ.get("DEDLOC_TARGET_GROUP_SIZE")
_UPLOADS = os.environ.get("DEDLOC_MAX_STATE_UPLOADS")

if _SIZE:
    from hivemind.averaging import averager as _averager

    _original_init = _averager.DecentralizedAverager.__init__

    def _init_with_group_size(self, *args, target_group_size=None, **kwargs):
        if target_group_size is None:
            target_group_size = int(_SIZE)
        _original_init(self, *args, target_group_size=target_group_size, **kwargs)

    _averager.DecentralizedAverager.__init__ = _init_with_group_size

if _UPLOADS:
    from common.hivemind_patches.patcher import Patcher
    from common.hivemind_patches.uploads import limit_concurrent_state_uploads

    limit_concurrent_state_uploads(Patcher(), int(_UPLOADS))
