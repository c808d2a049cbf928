"""Benchmark-only: hivemind's ``target_group_size`` for every averager of a peer, from the environment.

``scale_swarm.py --target-group-size N`` puts this folder on its peers' PYTHONPATH with DEDLOC_TARGET_GROUP_SIZE=N,
so that the trial of issue 43 can compare averaging groups with and without a cap. Our config has no key for it
(hivemind 1.1.12's Optimizer takes no ``target_group_size``; only its averagers do), so this sets the averagers'
default instead; a run config that wants a cap needs a ``collaboration.target_group_size`` handed to both
averagers in common/optimizer.py, and then this file goes. Without the variable it does nothing.
"""

import os

_SIZE = os.environ.get("DEDLOC_TARGET_GROUP_SIZE")

if _SIZE:
    from hivemind.averaging import averager as _averager

    _original_init = _averager.DecentralizedAverager.__init__

    def _init_with_group_size(self, *args, target_group_size=None, **kwargs):
        if target_group_size is None:
            target_group_size = int(_SIZE)
        _original_init(self, *args, target_group_size=target_group_size, **kwargs)

    _averager.DecentralizedAverager.__init__ = _init_with_group_size
