"""Serving and training: vLLM, the capture gateway, the GRPO trainer, the local backend, the CLI.

Importing this package is light; ``LocalBackend`` loads torch and friends when first used.
"""

from typing import Any

__all__ = ["LocalBackend"]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from .local import LocalBackend

        return LocalBackend
    raise AttributeError(f"module 'journeyman.backend' has no attribute {name!r}")
