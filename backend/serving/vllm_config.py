"""How a vLLM server is started (:class:`VLLMConfig`), and the facts about this host its defaults
depend on: a free port, a visible NVIDIA GPU, a CPU that computes in bf16."""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from journeyman.errors import ConfigError

__all__ = ["PLUGIN_DIR", "VLLMConfig", "core_list", "cpu_has_bf16", "cuda_available", "free_port"]


def core_list(spec: str) -> list[int]:
    """``"0"``, ``"0-3"``, ``"0,2-3"`` -> the core ids in order (``VLLMConfig.cpu_cores``, the form of
    ``VLLM_CPU_OMP_THREADS_BIND``; its ``|`` between ranks reads as a comma)."""
    cores: list[int] = []
    try:
        for part in spec.replace("|", ",").split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        raise ConfigError(
            f"cpu_cores={spec!r} is not a list of cores: write it as '0', '0-3' or '0,2-3'"
        ) from None
    return cores


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cuda_available() -> bool:
    """True when an NVIDIA GPU is visible (checked without importing torch)."""
    return (
        shutil.which("nvidia-smi") is not None
        and subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0
    )


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when this CPU computes in bf16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo.
    Elsewhere bf16 matmuls are emulated, and both plain matmuls and vLLM's linear layers run many
    times slower in bf16 than in fp32 (see docs/results/)."""
    try:
        flags = next(
            (line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), ""
        ).split()
    except OSError:
        return True  # not Linux: leave the choice to vLLM's default for the platform
    return "avx512_bf16" in flags or "amx_bf16" in flags


PLUGIN_DIR = Path(__file__).parent / "vllm_plugin"


@dataclass(frozen=True)
class VLLMConfig:
    """How to start the server. Defaults suit the embedded 135M model on a 2-core CPU."""

    model: str | Path
    """A Hugging Face folder (or hub name on machines that have access)."""
    served_name: str = "base"
    """The name the base model is served under."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None picks a free port."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str = "auto"
    """Weights and activations (``--dtype``). ``auto``: bfloat16 on CUDA and on CPUs with bf16
    instructions, float32 on other CPUs, where bf16 is emulated and much slower (:func:`cpu_has_bf16`). A
    server asked for ``float32`` on CPU gives a token the same numbers whatever its batch and
    however its prompt is split (the ``journeyman_cpu_exact`` plugin: linear layers in tiles of
    16 rows, attention per query; ``JOURNEYMAN_CPU_EXACT=0`` turns it off): a seeded request
    samples the same tokens with the same logprobs, bit for bit, alone or among others, in
    prefill chunks or after a prefix-cache hit, at some cost to a long prompt's first prefill."""
    max_model_len: int = 4096
    enable_lora: bool = True
    max_lora_rank: int = 16
    """Largest LoRA rank that can be loaded; a larger adapter is refused with a clear error."""
    max_loras: int = 2
    """Adapters usable in one batch (more can stay loaded; vLLM swaps them)."""
    kv_cache_gib: float = 2.0
    """KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    gpu_memory_utilization: float | None = None
    """Share of the GPU's memory this server takes on CUDA (``--gpu-memory-utilization``): its
    weights, activations and KV cache. None: ``LocalBackend`` sizes it from the models' shapes, so
    that the policy's server, a judge's and the trainer fit one GPU (``backend/serving/gpu_memory.py``);
    a server started on its own takes 0.5. A number given here wins over the plan."""
    sleep_mode: bool = False
    """CUDA only: start vLLM with ``--enable-sleep-mode``, so that it can hand its weights (copied to
    CPU memory) and KV cache back while the trainer steps (:meth:`VLLMServer.sleep`, ``wake_up``);
    turns on vLLM's development endpoints, so the server must bind to loopback."""
    tool_parser: str | None = "auto"
    """Tool-call parser for ``--enable-auto-tool-choice``: ``auto`` picks it from the model's chat
    template (``backend/serving/families.py``; ``journeyman``, our tolerant hermes parser, for ``<tool_call>``
    templates), a name picks one of vLLM's, None disables tool calling."""
    chat_template: Path | None = None
    """Chat template file; by default the model folder's tool-aware template when it has one, else
    the tokenizer's own."""
    cpu_cores: str = "auto"
    """CPU only: cores vLLM runs on, e.g. ``"0"`` or ``"0-3"`` (by process affinity and as many
    threads; with ``cpu_single_process=False``, vLLM binds them, ``VLLM_CPU_OMP_THREADS_BIND``).
    Binding keeps vLLM from fighting the trainer for the same cores."""
    reserved_cpus: int | None = None
    """CPU only, with ``cpu_cores="auto"``: cores left for the API front end, not given inference
    threads (``VLLM_CPU_NUM_OF_RESERVED_CPU``; None: one when there are several)."""
    cpu_single_process: bool = True
    """CPU only, one worker: run the model inside vLLM's engine process (its ``uni`` executor)
    rather than in a worker process of its own: it starts sooner (one import of vLLM fewer) and
    decodes more tokens/s under concurrent requests (see docs/results/)."""
    merge_adapters: bool = False
    """Serve one trained model with each new adapter merged into the base weights, reloaded in
    place, instead of as a LoRA adapter (``backend/serving/merge.py``): vLLM runs without LoRA, which on
    CPU keeps its compiled graphs and decodes faster (see docs/results/). Only the current version is
    served. Turns on vLLM's development endpoints, so the server must bind to loopback."""
    cpu_lora_plugin: bool = True
    """CPU only: apply LoRA with one matmul per adapter instead of vLLM's per-token gathers
    (``backend/serving/vllm_plugin``; same numbers, less LoRA time per decode step)."""
    tensor_parallel_size: int = 1
    """GPUs one replica's weights are split over (``--tensor-parallel-size``)."""
    data_parallel_size: int = 1
    """Engine copies inside this server, each on its own GPUs (``--data-parallel-size``); for
    replicas on several machines, see ``backend/serving/replicas.py``."""
    startup_timeout: float = 900.0
    """Seconds to wait for /health: a server without LoRA compiles its graphs first, which on a small
    CPU takes minutes for a model of a few hundred million parameters."""
    extra_args: tuple[str, ...] = ()
    """Further command-line arguments passed to vLLM as they are."""
    env: dict[str, str] = field(default_factory=dict)
    """Further environment variables for the server process."""
