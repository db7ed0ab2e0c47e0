"""The scripts of examples/ as modules, for the tests of both tiers (examples/ is no package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parents[1] / "examples"


def load(name: str, script: str | None = None) -> ModuleType:
    """An example script as a module (examples/ is no package: each script stands alone);
    ``script``: its file in the example's folder, when not named after the folder."""
    if f"example_{name}" in sys.modules:
        return sys.modules[f"example_{name}"]
    path = EXAMPLES / name / (script or f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
