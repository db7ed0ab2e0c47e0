"""Serving and training, and the service that joins them.

=====================  ======================================================================
``serving/``           vLLM as a subprocess (``vllm``, its plugin and chat templates), the
                       capture gateway, the router that deploys adapters, replicas, merging.
``training/``          the GRPO LoRA trainer, its losses, batching, kernels, data parallelism.
``local.py``           :class:`LocalBackend`: one inference server, the gateway and the trainer.
``models.py``          the embedded models and their one-time conversion, used by both halves.
``settings.py``        where things are kept (environment variables).
``app/``               the application on top: the command line, the demo, the HTTP server.
=====================  ======================================================================

Serving and training never import each other: ``local.py`` is the seam. Importing this package
is light; ``LocalBackend`` loads torch and friends when first used.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports it on first use
    from .local import LocalBackend

__all__ = ["LocalBackend"]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from .local import LocalBackend

        return LocalBackend
    raise AttributeError(f"module 'journeyman.backend' has no attribute {name!r}")
