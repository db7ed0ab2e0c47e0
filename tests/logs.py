"""Log capture that holds whatever logging state earlier tests left behind."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def reaching_caplog(name: str = "journeyman") -> Iterator[None]:
    """For the block, ``name``'s logger and every one under it is enabled, propagates and leaves the
    level to the root (where caplog sets it), and ``logging.disable`` is off: their records reach
    caplog. An earlier test can leave one disabled or not propagating (a ``dictConfig`` disables the
    loggers it does not name); a check that caplog lacks something would then pass unseen."""
    manager = logging.root.manager
    loggers = [logging.getLogger(name)] + [
        logger
        for other, logger in manager.loggerDict.items()
        if other.startswith(f"{name}.") and isinstance(logger, logging.Logger)
    ]
    saved = [(logger, logger.disabled, logger.propagate, logger.level) for logger in loggers]
    disabled = manager.disable
    logging.disable(logging.NOTSET)
    for logger in loggers:
        logger.disabled, logger.propagate = False, True
        logger.setLevel(logging.NOTSET)
    try:
        yield
    finally:
        logging.disable(disabled)
        for logger, was_disabled, propagate, level in saved:
            logger.disabled, logger.propagate = was_disabled, propagate
            logger.setLevel(level)
