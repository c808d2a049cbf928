"""One of timm's optimizers without timm's model zoo.

``import timm.optim`` first runs ``timm/__init__.py``, which imports every layer and model definition: about 3 s
of a peer's start-up (half of all its imports) for a trainer that only needs one optimizer class. The optimizer
modules themselves depend only on torch and two helper modules of ``timm.optim``, so they are loaded under
empty stand-ins for the two parent packages; the stand-ins are removed afterwards, so a later ``import timm``
(SwAV's ResNet) still gets the real package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path


def timm_optimizer(module: str, name: str) -> type:
    """``timm.optim.<module>.<name>`` (e.g. ``("lamb", "Lamb")``), importing as little of timm as possible."""
    if "timm" in sys.modules:  # the real package is already loaded: nothing to save
        return getattr(importlib.import_module(f"timm.optim.{module}"), name)
    spec = importlib.util.find_spec("timm")  # locates the package without running it
    root = Path(spec.origin).parent
    stand_ins = {"timm": root, "timm.optim": root / "optim"}
    for package, folder in stand_ins.items():
        stand_in = types.ModuleType(package)
        stand_in.__path__ = [str(folder)]
        sys.modules[package] = stand_in
    try:
        return getattr(importlib.import_module(f"timm.optim.{module}"), name)
    finally:
        for loaded in [key for key in sys.modules if key == "timm" or key.startswith("timm.")]:
            del sys.modules[loaded]
