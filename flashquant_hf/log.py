"""One-time warnings: each distinct message is logged once per process (a decode step repeats every call)."""

from __future__ import annotations

import logging

_warned: set[str] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    """Log ``message`` as a warning on ``logger`` unless it was logged before."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
