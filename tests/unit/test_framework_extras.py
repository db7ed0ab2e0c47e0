"""A tracer whose framework is not installed says which extra installs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("openai_agents", "agents", "openai-agents"),
        ("pydantic_ai", "pydantic_ai", "pydantic-ai"),
        ("crewai", "crewai", "crewai"),
    ],
)
def test_a_missing_framework_names_its_extra(module: str, framework: str, extra: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {framework!r}:
                    raise ImportError("not installed")
                return None

        sys.meta_path.insert(0, Block())
        import journeyman
        try:
            import journeyman.integrations.{module}
        except journeyman.MissingDependencyError as error:
            print(error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f'pip install "./journeyman[{extra}]"' in result.stdout
