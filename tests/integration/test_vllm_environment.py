"""The set-up built a separate environment in which the vLLM server can start."""

from __future__ import annotations

import subprocess

from journeyman.backend.settings import vllm_python


def test_vllm_environment_imports_the_server_and_is_separate() -> None:
    python = vllm_python()
    script = (
        "import importlib.util, vllm, vllm.entrypoints.openai.api_server, torch;"
        "print(vllm.__version__, torch.__version__, importlib.util.find_spec('crewai') is None)"
    )
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    version, torch_version, crewai_absent = result.stdout.split()[-3:]
    assert crewai_absent == "True"  # vLLM and crewai cannot share an environment
    assert version
    assert torch_version.startswith("2.")
