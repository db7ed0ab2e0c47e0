"""Moved to :mod:`journeyman.backend.serving.router`; this path keeps code written against 0.1 working."""

from .serving.router import *  # noqa: F403
from .serving.router import __all__ as __all__
