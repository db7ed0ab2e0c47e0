"""The set-up built a separate environment in which the vLLM server can start."""

from __future__ import annotations

import os
import subprocess

from journeyman.backend.serving.vllm import PLUGIN_DIR
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


PLUGIN_CHECK = """
import importlib.metadata, torch
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
names = [e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
assert "journeyman_cpu_lora" in names, names
torch.manual_seed(0)
dt = torch.bfloat16
outs = (576, 192, 192)
a = tuple(torch.randn(3, 1, 8, 576, dtype=dt) * 0.05 for _ in outs)
b = tuple(torch.randn(3, 1, o, 8, dtype=dt) * 0.05 for o in outs)
x = torch.randn(8, 576, dtype=dt)
mapping = (1, 2, 0, 1, 2, 2, 1, 0)  # two adapters and tokens with none, in one decode batch
def run():
    pw = PunicaWrapperCPU(2048, 256, "cpu")
    pw.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), [1, 2, None], 3, 49152)
    y = torch.randn(8, sum(outs), dtype=dt, generator=torch.Generator().manual_seed(1))
    pw.add_lora_linear(y, x, a, b, 0.5, outs)
    return y
before = torch.randn(8, sum(outs), dtype=dt, generator=torch.Generator().manual_seed(1))
original = run()
importlib.metadata.entry_points(group="vllm.general_plugins")["journeyman_cpu_lora"].load()()
patched = run()
has = torch.tensor([m != 0 for m in mapping])
# Same numbers where an adapter applies; untouched where none does (vLLM's per-token ops read
# the last adapter slot for those tokens, which is not the documented meaning of -1).
print((patched[has].float() - original[has].float()).abs().max().item(), torch.equal(patched[~has], before[~has]))
"""


def test_cpu_lora_plugin_is_found_and_computes_what_vllm_computes() -> None:
    env = {**os.environ, "PYTHONPATH": str(PLUGIN_DIR)}
    result = subprocess.run(
        [str(vllm_python()), "-c", PLUGIN_CHECK], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    difference, untouched = result.stdout.split()[-2:]
    assert float(difference) == 0.0
    assert untouched == "True"
