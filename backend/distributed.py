"""Moved to :mod:`journeyman.backend.training.distributed`; this path keeps code written against 0.1 working."""

from .training.distributed import *  # noqa: F403
from .training.distributed import __all__ as __all__
