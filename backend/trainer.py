"""Moved to :mod:`journeyman.backend.training.trainer`; this path keeps code written against 0.1 working."""

from .training.trainer import *  # noqa: F403
from .training.trainer import __all__ as __all__
