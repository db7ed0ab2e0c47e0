"""Moved to :mod:`journeyman.backend.serving.vllm`; this path keeps code written against 0.1 working."""

from .serving.vllm import *  # noqa: F403
from .serving.vllm import __all__ as __all__
