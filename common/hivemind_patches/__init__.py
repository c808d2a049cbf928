"""Every change this project makes to the pinned hivemind (1.1.12), installed once per process by :func:`install`.

``fixes`` holds the bug fixes (hivemind behaviour that is wrong), ``policies`` our own choices over behaviour that
is not (log levels, the state-download deadline, catch-up, the timing of gradient rounds, the signing key), and
``uploads`` the policy that limits concurrent state uploads (``collaboration.max_concurrent_state_uploads``). The
patch table in ``common/README.md`` lists each with its upstream status, its regression test and when to remove
it; upgrading hivemind means re-checking exactly this package.

:func:`install` runs before any hivemind process is forked (the DHT's, the averagers'), which inherit the patches:
``common.dht.start_dht`` calls it, so every peer role has it; tests install it in ``tests/conftest.py``; scripts
that use hivemind without ``start_dht`` call it themselves. It refuses any hivemind release but the pinned one.

Why runtime patches and not a patched hivemind built by ``scripts/setup_env.sh`` from the pinned wheel plus patch
files: (1) half of the layer cannot be a source patch anyway -- the policies and several fixes adapt one
``hivemind.Optimizer`` with this run's settings (the state-download deadline, catch-up, the grad scaler); (2) a
patched install lives outside the repository, so a volunteer who installs ``requirements.txt`` another way, or a
stale ``.venv``, would run stock hivemind silently, whereas these patches travel with the code that needs them and
the version check refuses a mismatch; (3) the regression tests disable one patch in the same process
(:func:`disabled`) to show the fault it fixes, which with a patched wheel would need a second installation; (4)
pip-installed files edited in place no longer match pip's record of them. The cost: patches replace private
internals, so each one names what it replaces and the version check stops an upgrade that was not re-checked.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Collection, Dict, Iterator, Optional

import hivemind

from common.errors import PeerError
from common.hivemind_patches import fixes, policies, uploads
from common.hivemind_patches.patcher import Patcher

PINNED_VERSION = "1.1.12"  # the hivemind release every patch here is written against
# Raise it whenever a patch changes what peers send each other or how they treat each other's messages: peers of
# one run must run the same patch set over the same hivemind (``software_fingerprint``, checked by
# ``common.backends.require_same_model``).
PATCH_SET_VERSION = "2026.12.2"

PROCESS_WIDE = {name: apply for name, apply in fixes.PROCESS_WIDE + policies.PROCESS_WIDE + uploads.PROCESS_WIDE}
PER_OPTIMIZER = dict(fixes.PER_OPTIMIZER)  # fixes that adapt one hivemind.Optimizer: install puts them in force
PATCHES = (*PROCESS_WIDE, *PER_OPTIMIZER)  # every patch, in the order install applies them
FIXES = frozenset(name for name, _ in fixes.PROCESS_WIDE + fixes.PER_OPTIMIZER)

# None until :func:`install`; then what each installed patch changed (the installed-flag, and what undoes a patch)
_installed: Optional[Dict[str, Patcher]] = None


def require_pinned_hivemind() -> None:
    """Refuse to patch another hivemind release: the patches replace its private internals."""
    if hivemind.__version__ != PINNED_VERSION:
        raise PeerError(
            f"hivemind {hivemind.__version__} is installed, but common/hivemind_patches patches hivemind "
            f"{PINNED_VERSION}: run bash scripts/setup_env.sh (requirements.txt pins it)"
        )


def install(without: Collection[str] = ()) -> None:
    """Apply every process-wide patch and put the per-optimizer fixes in force, once per process (later calls do
    nothing). ``without``: patches to leave out, for a regression check (``pytest --without-patch NAME``); the
    software fingerprint then names them, so such a peer is refused by the others."""
    global _installed
    if _installed is not None:
        return
    require_pinned_hivemind()
    unknown = set(without) - set(PATCHES)
    if unknown:
        raise ValueError(f"no such hivemind patch: {', '.join(sorted(unknown))} (known: {', '.join(PATCHES)})")
    installed = {}
    for name in PATCHES:
        if name not in without:
            installed[name] = _apply(name)
    _installed = installed


def _apply(name: str) -> Patcher:
    patcher = Patcher()
    if name in PER_OPTIMIZER:
        fixes.put_in_force(name, patcher)
    else:
        PROCESS_WIDE[name](patcher)
    return patcher


def require_installed() -> None:
    """For code that builds hivemind objects: the patches must be in place before their processes are forked."""
    if _installed is None:
        raise RuntimeError(
            "common.hivemind_patches.install() was not called in this process before building hivemind objects "
            "(common.dht.start_dht calls it)"
        )


@contextmanager
def disabled(name: str) -> Iterator[None]:
    """Undo one installed patch inside the block (for the regression tests: hivemind's own behaviour comes back),
    and apply it again after."""
    require_installed()
    patcher = _installed.pop(name)
    patcher.undo()
    try:
        yield
    finally:
        _installed[name] = _apply(name)


def software_fingerprint() -> str:
    """What a peer must share with the run besides the model: the hivemind release and our patch set over it."""
    fingerprint = f"hivemind {hivemind.__version__} + patch set {PATCH_SET_VERSION}"
    if _installed is None:
        return f"{fingerprint} (not installed)"
    missing = [name for name in PATCHES if name not in _installed]
    return f"{fingerprint} without {', '.join(missing)}" if missing else fingerprint
