"""The ``k3compile`` logger: its progress lines (INFO) and warnings shown on stderr by default, for as long as the
application has not configured logging (``optimize`` calls :func:`show_progress` at import)."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("k3compile")


class _UnlessConfigured(logging.StreamHandler):
    """stderr (as it is now), for as long as the application has not configured logging (a root handler
    then shows our records)."""

    def emit(self, record):
        if not logging.getLogger().handlers:
            self.stream = sys.stderr
            super().emit(record)


def show_progress() -> None:
    """Progress lines (INFO) and warnings visible by default; a level or handler set by the user stays."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, _UnlessConfigured) for h in log.handlers):
        handler = _UnlessConfigured()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
