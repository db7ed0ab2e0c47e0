"""Moved to :mod:`journeyman.backend.serving.gateway`; this path keeps code written against 0.1 working."""

from .serving.gateway import *  # noqa: F403
from .serving.gateway import __all__ as __all__
