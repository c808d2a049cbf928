"""What one patch changed in hivemind (or the standard library), kept so that the change can be undone."""

from __future__ import annotations

import logging
from typing import Any, Callable, List

_MISSING = object()


class Patcher:
    """Records each replacement a patch makes; :meth:`undo` restores the originals in reverse order. Undoing exists
    for the regression tests, which disable one patch to show the fault it fixes (``hivemind_patches.disabled``)."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def replace(self, owner: Any, attribute: str, value: Any) -> None:
        """Set ``owner.attribute`` (a class or a module); the raw attribute is kept, so a classmethod or
        staticmethod is restored as the descriptor it was."""
        original = vars(owner).get(attribute, _MISSING)
        setattr(owner, attribute, value)

        def restore() -> None:
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)

        self._undo.append(restore)

    def add_filter(self, logger_name: str, log_filter: logging.Filter) -> None:
        target = logging.getLogger(logger_name)
        target.addFilter(log_filter)
        self._undo.append(lambda: target.removeFilter(log_filter))

    def on_undo(self, restore: Callable[[], None]) -> None:
        self._undo.append(restore)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
