"""`import journeyman` must work where none of the heavy frameworks can be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = [
    "torch",
    "transformers",
    "peft",
    "vllm",
    "langchain",
    "langchain_core",
    "langchain_openai",
    "langgraph",
    "crewai",
    "agents",
    "pydantic_ai",
    "langfuse",
    "accelerate",
    "trl",
    "fastapi",
    "uvicorn",
    "gguf",
]


def test_core_imports_with_heavy_frameworks_blocked() -> None:
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys

        BLOCKED = set({HEAVY!r})

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked for this test: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        import journeyman
        import journeyman.integrations, journeyman.backend
        for module in pkgutil.iter_modules(journeyman.__path__):
            importlib.import_module("journeyman." + module.name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok", len(journeyman.__all__))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_blocking_really_blocks() -> None:
    """The blocker itself works: importing torch under it fails (so the test above means something)."""
    script = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        try:
            import torch
        except ImportError:
            print("blocked")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "blocked"
