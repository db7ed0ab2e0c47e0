"""LocalBackend: vLLM, the capture gateway and the trainer, in this process tree.

A watchdog checks the vLLM process every ``watch_interval`` seconds: if it died, requests get
503 from the gateway (clients fail fast, nothing hangs) while it is started again and the kept
adapters are loaded back, so the current version answers as before. A judge's server
(:meth:`LocalBackend.start_judge`) is restarted the same way.

Rollouts and training alternate (gather, then train), so by default both may use every core:
vLLM's inference threads are bound to all cores, and the trainer uses as many threads. Set
``vllm_cores``/``trainer_threads`` to split them when something else runs beside.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from journeyman.config import SFTConfig, TrainConfig
from journeyman.errors import BackendError, ConfigError
from journeyman.judge import Judge
from journeyman.model import Registration, ServingState, TrainableModel, TrainResult
from journeyman.store import ModelStore, check_writable, default_root
from journeyman.trajectory import Trajectory, TrajectoryGroup

from .models import fetch_hub_model, resolve_base_model
from .serving.adapters import AdapterPush
from .serving.engine import Engine, InferenceServer
from .serving.engine import engine as engine_of
from .serving.gateway import Gateway, GatewayThread, RecordLog
from .serving.gpu_memory import (
    JUDGE_SEQUENCES,
    POLICY_SEQUENCES,
    GpuMemoryPlan,
    ServerSpec,
    TrainerSpec,
    model_shape,
    visible_gpu_memory,
)
from .serving.replicas import Replicas
from .serving.router import Router
from .serving.vllm import VLLMConfig, VLLMServer, cuda_available
from .serving.vllm_config import core_list
from .training.device import parse_train_device
from .training.sft import SFTProgress
from .training.trainer import StepResult, Trainer

__all__ = ["LocalBackend"]

logger = logging.getLogger(__name__)


class LocalBackend:
    """Serves and trains models on this machine. ``async with LocalBackend() as backend: ...``"""

    def __init__(
        self,
        *,
        root: str | Path | None = None,
        vllm: VLLMConfig | None = None,
        vllm_cores: str | None = None,
        trainer_threads: int | None = None,
        keep_versions: int = 2,
        gateway_port: int | None = None,
        gateway_thread: bool = True,
        watch_interval: float = 2.0,
        push_to: AdapterPush | None = None,
        trainer_class: Callable[..., Trainer] = Trainer,
        merge_adapters: bool | None = None,
        replicas: int = 1,
        inference: bool = True,
        engine: str | Engine = "vllm",
        dtype: str | None = None,
        sleep_mode: bool = False,
        train_device: str = "auto",
        viewer: Callable[[Path], GatewayThread] | None = None,
    ) -> None:
        if replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {replicas}")
        if not inference and push_to is None:
            raise ConfigError(
                "a LocalBackend without inference only trains: give it push_to=AdapterPush([...]) so each "
                "step is served by the inference machines"
            )
        self.root = Path(root) if root is not None else default_root()
        self._vllm_config = vllm
        cores = os.cpu_count() or 1
        self.vllm_cores = vllm_cores or (f"0-{cores - 1}" if cores > 1 else "0")
        self.trainer_threads = trainer_threads or cores
        self.keep_versions = keep_versions
        self.gateway_port = gateway_port
        self.gateway_thread = gateway_thread
        """Serve the gateway on a thread and port of its own; False when an outer server (``journeyman
        serve``) routes to :attr:`gateway_app` on its own event loop."""
        self.gateway_app: Gateway | None = None
        self.engine = engine_of(engine)
        """Makes each inference server (``engine(config, log_path=...)``): vLLM unless a name in
        :data:`~journeyman.backend.serving.engine.ENGINES` or a class says otherwise."""
        self.server: InferenceServer | None = None
        self.router: Router | None = None
        self.gateway: GatewayThread | None = None
        self.records: RecordLog | None = None
        self.watch_interval = watch_interval
        self.restarts = 0
        """How many times the watchdog restarted a vLLM server that died."""
        self.restarting = False
        """True while the watchdog restarts the policy's server and loads its adapters again."""
        self.judge_restarts = 0
        """How many times it restarted a judge's server (:meth:`start_judge`)."""
        self.restarting_judges: set[str] = set()
        """The judges whose servers the watchdog is restarting."""
        self._base: Path | str | None = None
        self._trainers: dict[str, Trainer] = {}
        self._promote: dict[str, bool] = {}
        """Whether a model's next trained step moves its plain name (``train(promote=...)``)."""
        self._watchdog: asyncio.Task[None] | None = None
        self.push_to = push_to
        """Also deploy each trained step to these remote gateways (backend/serving/adapters.py)."""
        self.trainer_class = trainer_class
        """``LeaderTrainer`` under torchrun (backend/training/distributed.py)."""
        self.merge_adapters = merge_adapters
        """Serve each trained step merged into vLLM's weights (one trained model, faster decoding
        on CPU) instead of as a LoRA adapter; None keeps the ``vllm`` config's choice."""
        self.replicas = replicas
        """vLLM servers behind the gateway (backend/serving/replicas.py), each rollout sticking to
        one. On CPU the cores are split between them; on CUDA each gets its own GPUs."""
        self.inference = inference
        """False on a trainer-only machine: no local vLLM, each step goes to ``push_to``."""
        self.judge_servers: dict[str, InferenceServer] = {}
        """Judge models served by :meth:`start_judge`, by name; stopped with the backend."""
        self.dtype = dtype
        """vLLM's ``--dtype`` for every server this backend starts, the policy's and each judge's;
        None keeps each config's own (``auto``: bf16 where the CPU or GPU has it). ``float32`` on
        CPU makes seeded sampling batch-invariant: a request samples the same tokens alone or
        among others (``VLLMConfig.dtype`` says where that ends)."""
        self.train_device = parse_train_device(train_device)
        """Where the trainer trains: ``auto`` (the GPU when torch sees one, else the CPU), ``cpu``,
        ``cuda`` or ``cuda:N``. The model is loaded there and every tensor of a step is made there."""
        self.sleep_mode = sleep_mode
        """CUDA only: the policy's vLLM server sleeps while the trainer steps (vLLM's sleep mode,
        level 1: its weights copied to CPU memory, its KV cache dropped), so the trainer may use that
        memory; it wakes before the step is deployed, and requests that arrive meanwhile wait for it.
        The seconds each took are the step's ``time/sleep`` and ``time/wake`` metrics (in the
        :class:`TrainResult`; the history's ``time/deploy`` includes the wake). Ignored on CPU."""
        self.gpu_memory: GpuMemoryPlan | None = None
        """On CUDA, how the GPU is shared by this backend's vLLM servers and the trainer
        (``backend/serving/gpu_memory.py``): planned as each server starts, logged as a table."""
        self._memory_parts: dict[str, ServerSpec] = {}
        self._asleep = False
        self._sleep_times: dict[str, float] = {}
        self.viewer = viewer
        """Starts the run viewer over :attr:`root` on a thread and port of its own (the application's
        ``journeyman.backend.app.ui.app.start_viewer``, which this library module may not import):
        started by the first :meth:`register`, stopped by :meth:`close`; :meth:`viewer_url` says
        where a model's run is. None serves no viewer."""
        self._viewer: GatewayThread | None = None

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, base: Path | str) -> None:
        if self.server is not None:
            if str(base) != str(self._base):
                raise ConfigError(
                    f"this LocalBackend serves {self._base}; {base} needs a LocalBackend of its own "
                    "(one vLLM server serves one base model)"
                )
            return
        config = self._vllm_config or VLLMConfig(model=base)
        config = replace(
            config, model=base, cpu_cores=self.vllm_cores, reserved_cpus=0, dtype=self.dtype or config.dtype
        )
        if self.merge_adapters is not None:
            config = replace(config, merge_adapters=self.merge_adapters)
        if self.sleep_mode and _on_cuda(config):
            config = replace(config, sleep_mode=True)
        try:
            self.server = self._servers(self._planned(config, "policy"))
        except BaseException:
            self._memory_parts.pop("policy", None)
            raise
        self.server.launch()  # from this (long-lived) thread: the server lives with the caller
        try:
            await asyncio.to_thread(self.server.wait_healthy)
        except BaseException:
            self.server.stop()
            self.server = None
            self._memory_parts.pop("policy", None)
            raise
        self._base = base
        self.router = Router(self.server, keep_versions=self.keep_versions)
        self.records = RecordLog(self.root / "gateway" / "completions.jsonl")
        self.gateway_app = Gateway(self.router, self.records)
        if self.gateway_thread:
            self.gateway = GatewayThread(self.gateway_app, port=self.gateway_port).start()
        if self._watchdog is None:  # a judge's server may have started first: its watchdog watches both
            self._watchdog = asyncio.create_task(self._watch(), name="journeyman-vllm-watchdog")

    @functools.cached_property
    def _visible_gpus(self) -> list[int]:
        """Each visible GPU's memory in bytes (:func:`visible_gpu_memory`), read once."""
        return visible_gpu_memory()

    def _server_gpus(self) -> list[str] | None:
        """With two GPUs or more and ``train_device="auto"``, the dedicated layout: the trainer
        takes the last visible GPU and the vLLM servers (policy's and judges') the others, as
        ``CUDA_VISIBLE_DEVICES`` entries; None where they share (one GPU, a named train device, or
        servers that need every GPU)."""
        if self.train_device != "auto" or not self.inference:
            return None
        count = len(self._visible_gpus)
        config = self._vllm_config
        per = config.tensor_parallel_size * config.data_parallel_size if config is not None else 1
        if count < 2 or self.replicas * per > count - 1:
            return None
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [entry.strip() for entry in listed.split(",")] if listed else [str(i) for i in range(count)]
        return names[: count - 1]

    def _trainer_device(self) -> str:
        """The trainer's device: the last visible GPU in the dedicated layout, else ``train_device``."""
        servers = self._server_gpus()
        return f"cuda:{len(servers)}" if servers is not None else self.train_device

    def _on_server_gpus(self, config: VLLMConfig) -> VLLMConfig:
        """``config`` restricted to the servers' GPUs in the dedicated layout (unless it names its own)."""
        servers = self._server_gpus()
        if servers is None or "CUDA_VISIBLE_DEVICES" in config.env or not _on_cuda(config):
            return config
        return replace(config, env={**config.env, "CUDA_VISIBLE_DEVICES": ",".join(servers)})

    def _servers(self, config: VLLMConfig) -> InferenceServer:
        logs = self.root / "logs"
        if _on_cuda(config):
            per = config.tensor_parallel_size * config.data_parallel_size
            visible = len(self._visible_gpus)
            if visible and self.replicas * per > visible:  # none read (MIG, no nvidia-smi): vLLM says
                fix = (
                    f"set replicas (journeyman serve --replicas) to {visible // per} or fewer"
                    if per <= visible
                    else f"set tensor_parallel_size x data_parallel_size to {visible} or fewer"
                )
                raise ConfigError(
                    f"{self.replicas} replica(s) x tensor_parallel_size {config.tensor_parallel_size} x "
                    f"data_parallel_size {config.data_parallel_size} need {self.replicas * per} GPUs, and "
                    f"{visible} {'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): {fix}, or make more GPUs visible"
                )
        if self.replicas == 1:
            return self.engine(self._on_server_gpus(config), log_path=logs / "vllm.log")
        servers = []
        for i in range(self.replicas):
            if cuda_available():
                per = config.tensor_parallel_size * config.data_parallel_size
                names = self._server_gpus() or [str(g) for g in range(self.replicas * per)]
                gpus = ",".join(names[i * per : (i + 1) * per])
                replica = replace(config, env={**config.env, "CUDA_VISIBLE_DEVICES": gpus})
            else:
                replica = replace(config, cpu_cores=_share(self.vllm_cores, i, self.replicas))
            servers.append(self.engine(replica, log_path=logs / f"vllm{i}.log"))
        return Replicas(servers)

    def _planned(self, config: VLLMConfig, role: str) -> VLLMConfig:
        """On CUDA: ``config`` with the ``gpu_memory_utilization`` of this backend's memory plan
        (an explicit one is kept), once the plan of every server it runs, ``role``'s included, and
        of the trainer fits the GPU; else a ConfigError that says what each part needs and what would
        fit. The plan is logged as a table. Elsewhere, or for a model without a ``config.json``,
        ``config`` as it is."""
        if not _on_cuda(config):
            return config
        gpus, shape = self._visible_gpus, model_shape(config.model)
        if not gpus or shape is None:
            logger.warning(
                "no GPU memory plan for %s (%s); its vLLM server takes gpu_memory_utilization=%s",
                config.model, "no GPU size from nvidia-smi" if not gpus else "no config.json",
                config.gpu_memory_utilization or "0.5 (the default)",
            )  # fmt: skip
            return config
        sequences = POLICY_SEQUENCES if role == "policy" else JUDGE_SEQUENCES
        spec = ServerSpec(
            role, shape, config.max_model_len, sequences, config.gpu_memory_utilization, config.sleep_mode
        )
        servers = {**self._memory_parts, role: spec}
        policy = servers.get("policy")
        trainer = TrainerSpec(policy.shape) if policy is not None and self._trains_on_gpu() else None
        plan = GpuMemoryPlan(min(gpus), tuple(servers.values()), trainer)
        if not plan.fits and plan.with_gradient_checkpointing().fits:
            plan = plan.with_gradient_checkpointing()
            logger.warning(
                "the trainer fits beside the vLLM servers only with gradient_checkpointing=True in TrainConfig"
            )
        plan.check()
        self._memory_parts[role] = spec
        self.gpu_memory = plan
        logger.info("%s", plan)
        return replace(config, gpu_memory_utilization=plan.utilization(role))

    def _trains_on_gpu(self) -> bool:
        """Whether this backend's trainer takes memory on the GPU its servers use: it trains here,
        on its default device or CUDA (a ``train_device`` of ``cpu`` takes none, nor a trainer on a
        GPU of its own in the dedicated layout)."""
        return self.inference and self.train_device != "cpu" and self._server_gpus() is None

    def _sleepers(self) -> list[VLLMServer]:
        """The policy's servers that sleep while the trainer steps (``sleep_mode`` on CUDA)."""
        servers: list[Any] = list(getattr(self.server, "servers", [self.server]))
        return [
            s for s in servers if isinstance(s, VLLMServer) and s.config.sleep_mode and s.device == "cuda"
        ]

    async def _sleep(self) -> None:
        """Put the policy's servers to sleep for a training step (with ``sleep_mode``)."""
        if self._asleep or not (servers := self._sleepers()):
            return
        start = time.perf_counter()
        await asyncio.gather(*(server.sleep() for server in servers))
        self._asleep = True
        self._sleep_times["time/sleep"] = time.perf_counter() - start

    async def _wake(self) -> None:
        """Wake the policy's servers after a step (before it is deployed); a no-op when awake."""
        if not self._asleep:
            return
        start = time.perf_counter()
        await asyncio.gather(*(server.wake_up() for server in self._sleepers()))
        self._asleep = False
        self._sleep_times["time/wake"] = time.perf_counter() - start

    async def _watch(self) -> None:
        """Restart vLLM when its process has exited, and load the kept adapters again; restart a
        judge's server the same way (its requests fail, are retried and recorded meanwhile)."""
        while True:
            await asyncio.sleep(self.watch_interval)
            for name, server in list(self.judge_servers.items()):
                if server.exit_code() is not None:
                    await self._restart_judge(name, server)
            if self.router is None or self.router.server.exit_code() is None:
                continue
            self.restarting = True
            try:
                await self.router.restart_server()
                self.restarts += 1
                logger.warning("vLLM restarted (%d restart(s) so far); adapters redeployed", self.restarts)
            except Exception:
                logger.exception("restarting vLLM failed; trying again in %.0f s", 10 * self.watch_interval)
                await asyncio.sleep(10 * self.watch_interval)
            finally:
                self.restarting = False

    def policy_down(self) -> bool:
        """Whether the policy's server is dead or being restarted (its requests fail meanwhile)."""
        return self.router is not None and (self.restarting or self.router.server.exit_code() is not None)

    def judge_down(self) -> bool:
        """Whether a judge's server (:meth:`start_judge`) is dead or being restarted."""
        dead = any(server.exit_code() is not None for server in self.judge_servers.values())
        return dead or bool(self.restarting_judges)

    async def serving_state(self) -> ServingState:
        """The watchdog's restarts of the policy's and the judges' servers so far, and whether
        either is down now."""
        return ServingState(
            policy_restarts=self.restarts,
            judge_restarts=self.judge_restarts,
            policy_down=self.policy_down(),
            judge_down=self.judge_down(),
        )

    async def wait_serving(self, timeout: float = 900.0, *, judges: bool = False) -> None:
        """Until the watchdog has the policy's server answering again, with its adapters loaded
        (``judges``: the judges' servers instead)."""
        down, what = (self.judge_down, "judges'") if judges else (self.policy_down, "policy's")
        deadline = time.monotonic() + timeout
        while down():
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the {what} vLLM server was not back within {timeout:.0f} s; see {self.root / 'logs'}"
                )
            await asyncio.sleep(0.5)

    async def _restart_judge(self, name: str, server: InferenceServer) -> None:
        logger.warning(
            "the judge server for %s exited (code %s; killed for memory if -9: see %s); restarting it",
            name, server.exit_code(), server.log_path,
        )  # fmt: skip
        self.restarting_judges.add(name)
        try:
            server.stop()
            server.launch()
            await asyncio.to_thread(server.wait_healthy)
            self.judge_restarts += 1
        except Exception:
            logger.exception("restarting the judge server for %s failed; trying again later", name)
            await asyncio.sleep(10 * self.watch_interval)
        finally:
            self.restarting_judges.discard(name)

    async def register(self, model: TrainableModel) -> Registration:
        for folder in (self.root, model.store.path):  # fail now, not after vLLM started
            await asyncio.to_thread(check_writable, folder)
        base = await asyncio.to_thread(base_folder, model.base_model)  # a hub name fails or downloads now
        if self.viewer is not None and self._viewer is None:
            self._viewer = await asyncio.to_thread(self.viewer, self.root)
        if self.inference:
            await self._serve(base)
        router = self.router
        if model.name in self._trainers:
            trainer = self._trainers[model.name]
        else:
            push = self.push_to.deployer(model.name, str(model.base_model)) if self.push_to else None

            async def deploy(path: Path, step: int) -> Any:
                await self._wake()  # with sleep_mode: the step's memory is handed back by now
                promote = self._promote.get(model.name, True)
                served = (
                    await router.deploy(model.name, path, step, promote=promote)
                    if router is not None
                    else None
                )
                pushed = await push(path, step) if push is not None else None
                return served if router is not None else pushed

            trainer = self.trainer_class(
                base, model.store, lora=model.lora, threads=self.trainer_threads, deploy=deploy,
                device=self._trainer_device(),
            )  # fmt: skip
            await asyncio.to_thread(trainer.load)
            self._trainers[model.name] = trainer
            if router is None:
                assert self.push_to is not None
                # The inference machines serve the current step (a push they already have is fine).
                await self.push_to.push(
                    model.name, str(model.base_model), trainer.adapter_path(), trainer.step, existing_ok=True
                )
            else:
                promoted = model.store.promoted_step()
                if promoted is None or promoted == trainer.step:
                    await router.deploy(model.name, self._adapter(model, trainer.step), trainer.step)
                else:  # a gate held the latest steps back: production keeps the promoted one
                    await router.deploy(model.name, self._adapter(model, promoted), promoted)
                    if not router.merged:  # merged weights hold one version: the promoted one
                        await router.deploy(model.name, trainer.adapter_path(), trainer.step, promote=False)
                if (canary := model.store.running_canary()) is not None and not router.merged:
                    step, share = canary
                    await router.set_canary(model.name, step, trainer.adapter_path(step), share)
        if not self.inference:
            assert self.push_to is not None  # rollouts go to the first inference machine's gateway
            return Registration(f"{self.push_to.urls[0]}/v1", self.push_to.token or "-", trainer.step)
        base_url = f"{self.gateway.base_url}/v1" if self.gateway is not None else ""
        return Registration(base_url=base_url, api_key="local", step=trainer.step)

    async def start_judge(
        self, model: str, *, vllm: VLLMConfig | None = None, cores: str | None = None, **judge: Any
    ) -> Judge:
        """Serve ``model`` (an embedded alias, a folder or a hub name) as a judge beside the policy,
        on a vLLM server of its own (base weights, no LoRA, no tools), and return a :class:`Judge`
        that calls it; ``judge`` holds further :class:`Judge` arguments (its answers are cached
        under this backend's root unless ``cache_dir`` says otherwise). The server is stopped with
        the backend. Judging, rollouts and training take turns, so by default it is bound to the
        same cores as the policy's server (``cores`` splits them otherwise). On CPU it runs eager:
        a judge reads far more than it writes, and compiling its graphs takes minutes.
        """
        if model in self.judge_servers:
            server = self.judge_servers[model]
        else:
            base = await asyncio.to_thread(base_folder, model)
            name = Path(str(model)).name  # served under its own name: a judge's name keys its cache
            config = vllm or VLLMConfig(
                model=base, served_name=name, enable_lora=False, tool_parser=None,
                max_model_len=8192, kv_cache_gib=1.0, extra_args=() if cuda_available() else ("--enforce-eager",),
            )  # fmt: skip
            config = replace(
                config,
                model=base,
                cpu_cores=cores or self.vllm_cores,
                reserved_cpus=0,
                dtype=self.dtype or config.dtype,
            )
            role = f"judge {name}"
            server = self.engine(
                self._on_server_gpus(self._planned(config, role)),
                log_path=self.root / "logs" / f"judge-{name}.log",
            )
            server.launch()
            try:
                await asyncio.to_thread(server.wait_healthy)
            except BaseException:
                server.stop()
                self._memory_parts.pop(role, None)
                raise
            self.judge_servers[model] = server
            if self._watchdog is None:  # a backend that serves no policy still watches its judges
                self._watchdog = asyncio.create_task(self._watch(), name="journeyman-vllm-watchdog")
        return Judge(server.config.served_name, base_url=f"{server.base_url}/v1", **self._cached(judge))

    async def judge(self, model: TrainableModel, judge_model: str | None = None, **judge: Any) -> Judge:
        """A judge for ``model``'s groups: ``model``'s base weights, answered by the policy's own
        server through the gateway (``judge_model`` None or the same base model: no second server),
        else ``judge_model`` on a server of its own (:meth:`start_judge`). ``judge`` holds further
        :class:`Judge` arguments."""
        if judge_model is not None and judge_model != model.base_model:
            return await self.start_judge(judge_model, **judge)
        if self.router is None:
            raise ConfigError(
                f"register {model.name!r} with this backend before asking for its base model as a judge"
            )
        return Judge(
            self.router.base_name,
            base_url=model.inference_base_url,
            api_key=model.inference_api_key,
            **self._cached(judge),
        )

    def metrics_url(self) -> str | None:
        """The policy's vLLM server's Prometheus metrics (the first replica's); None before it starts."""
        return None if self.server is None else f"{self.server.base_url}/metrics"

    def viewer_url(self, model: TrainableModel) -> str | None:
        """Where this backend's viewer (``viewer``) shows ``model``'s run; None without a viewer,
        before the first :meth:`register`, or for a model whose runs live under another root."""
        if self._viewer is None or model.store.root.resolve() != self.root.resolve():
            return None
        return f"{self._viewer.base_url}/runs/{model.project}/{model.name}"

    def _cached(self, judge: dict[str, Any]) -> dict[str, Any]:
        """``judge``'s arguments, its answers cached under this backend's root by default (not the
        working directory's: a run with a root of its own asks its judge afresh)."""
        return {"cache_dir": self.root / "judge_cache", **judge}

    async def deploy_adapter(self, name: str, base_model: str, adapter_dir: Path, step: int) -> str:
        """Serve an adapter trained elsewhere as ``name@step`` (and ``name``); start vLLM if needed."""
        base = await asyncio.to_thread(base_folder, base_model)
        await self._serve(base)
        assert self.router is not None
        return await self.router.deploy(name, adapter_dir, step)

    def _trainer(self, model: TrainableModel) -> Trainer:
        try:
            return self._trainers[model.name]
        except KeyError:
            raise ConfigError(f"model {model.name!r} is not registered with this backend") from None

    def describe_trainer(self, model: TrainableModel) -> str:
        """The engine, device and dtype ``model`` trains with, e.g. ``"transformers on cuda:0
        (NVIDIA H100 80GB HBM3) in bfloat16"``."""
        return self._trainer(model).describe()

    async def get_step(self, model: TrainableModel) -> int:
        return self._trainer(model).step

    async def train(
        self,
        model: TrainableModel,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        *,
        promote: bool = True,
    ) -> TrainResult:
        return await self._step(model, promote, lambda trainer: trainer.train(groups, config))

    async def _step(
        self, model: TrainableModel, promote: bool, train: Callable[[Trainer], Awaitable[StepResult]]
    ) -> TrainResult:
        """One step of ``model``'s trainer (``train``: an RL or a supervised one), served and
        recorded alike: promoted or pinned, the policy's server asleep through it where it sleeps."""
        trainer = self._trainer(model)
        if not promote and self.router is None:
            raise ConfigError("promote=False needs this backend to serve the model (inference=True)")
        if not promote and model.store.follows_training():
            # Until now the plain name followed every step; write down the one it serves.
            row = {"action": "promote", "step": trainer.step, "by": "train", "pinned": True}
            await asyncio.to_thread(model.store.append_promotion, row)
        self._promote[model.name] = promote
        # With sleep_mode the policy's server sleeps through the step and wakes in the deploy
        # callback, before the step is loaded (its time/deploy includes the wake); a step that
        # deploys nothing, or fails, wakes it here.
        self._sleep_times = {}
        await self._sleep()
        try:
            result = await train(trainer)
        finally:
            self._promote[model.name] = True
            await self._wake()
        if promote and self.router is not None:
            await asyncio.to_thread(
                model.store.append_promotion, {"action": "promote", "step": result.step, "by": "train"}
            )
        return TrainResult(result.step, {**result.metrics, **self._sleep_times})

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Sequence[Trajectory],
        config: SFTConfig,
        *,
        evaluation: Sequence[Trajectory] | None = None,
        promote: bool = True,
        progress: SFTProgress | None = None,
    ) -> TrainResult:
        """A supervised run on ``model``'s adapter as its next step, deployed like an RL step
        (:meth:`Trainer.train_sft`); ``progress`` hears of each batch."""
        return await self._step(
            model,
            promote,
            lambda trainer: trainer.train_sft(trajectories, config, evaluation, progress or _log_batches),
        )

    async def promote(
        self,
        model: TrainableModel,
        step: int,
        *,
        action: str,
        by: str,
        gate: dict[str, Any] | None,
        share: float | None = None,
    ) -> int:
        """Move ``model``'s plain name to ``step`` and record it (``action`` promote or rollback;
        rollback with step -1: the step promoted before the current one); ``canary`` sends
        ``share`` of its rollouts to ``step``; ``hold`` records a gate that kept the name (and ends
        a canary)."""
        trainer = self._trainer(model)
        store = model.store
        step, current = move_target(store, step, action, latest=trainer.step)
        if self.router is None:
            raise ConfigError(f"{action} needs this backend to serve the model (inference=True)")
        adapter = self._adapter(model, step)
        if action == "canary":
            if share is None or adapter is None:
                raise ConfigError("a canary needs a trained step (not 0) and a share between 0 and 1")
            await self.router.set_canary(model.name, step, adapter, share)
        elif action == "hold":
            self.router.canaries.pop(model.name, None)
        else:
            await self.router.promote(model.name, step, adapter)
        row = {"action": action, "step": step, "from_step": current, "by": by}
        row |= ({"gate": gate} if gate else {}) | ({"share": share} if share is not None else {})
        await asyncio.to_thread(store.append_promotion, row)
        return step

    async def promoted_step(self, model: TrainableModel) -> int:
        promoted = model.store.promoted_step()
        return self._trainer(model).step if promoted is None else promoted

    def _adapter(self, model: TrainableModel, step: int) -> Path | None:
        """What serves ``step``: its checkpoint's adapter; None for step 0, whose adapter is peft's
        no-op initialisation (the base model answers the same, and faster: LoRA roughly halves
        CPU throughput)."""
        return None if step == 0 else self._trainer(model).adapter_path(step)

    async def list_checkpoints(self, model: TrainableModel) -> list[int]:
        return self._trainer(model).store.checkpoint_steps()

    async def delete_checkpoints(
        self, model: TrainableModel, best_metric: str | None, *, higher_is_better: bool = True
    ) -> list[int]:
        self._trainer(model)  # registered here
        return await asyncio.to_thread(
            functools.partial(model.store.prune_checkpoints, best_metric, higher_is_better=higher_is_better)
        )

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
            self.gateway = None
        if self._viewer is not None:
            await asyncio.to_thread(self._viewer.stop)
            self._viewer = None
        if self.gateway_app is not None and not self.gateway_thread:
            await self.gateway_app.aclose()
        self.gateway_app = None
        if self.records is not None:
            self.records.close()
            self.records = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        for server in self.judge_servers.values():
            server.stop()
        self.judge_servers.clear()
        self._trainers.clear()
        self._memory_parts.clear()
        self._asleep = False


def _on_cuda(config: VLLMConfig) -> bool:
    """Whether a server of ``config`` runs on an NVIDIA GPU (its ``device``, ``auto`` resolved here)."""
    return config.device == "cuda" or (config.device == "auto" and cuda_available())


def _share(cores: str, i: int, n: int) -> str:
    """Replica ``i`` of ``n``'s part of a core list like ``"0-3"`` or ``"0,2,4"`` (shared when too few)."""
    listed = core_list(cores)
    if len(listed) < n:
        return str(listed[i % len(listed)])
    per = len(listed) // n
    return ",".join(map(str, listed[i * per : (i + 1) * per]))


def base_folder(name: str) -> Path:
    """The folder that vLLM and the trainer read for base model ``name``: an embedded alias's
    converted folder, a folder as it is, or a hub name's snapshot, from the cache or downloaded once
    by this process before any server starts (:func:`~journeyman.backend.models.fetch_hub_model`)."""
    base = resolve_base_model(name)
    return base if isinstance(base, Path) else fetch_hub_model(base)


def move_target(store: ModelStore, step: int, action: str, *, latest: int | None) -> tuple[int, int | None]:
    """(the checkpointed step ``action`` moves to, the step the plain name serves now): a rollback
    with step -1 goes to the step promoted before; with no promotion recorded the name serves
    ``latest``. An error when the step has no checkpoint."""
    current = store.promoted_step()
    current = latest if current is None else current
    if action == "rollback" and step == -1:
        step = previous_promotion(store.read_promotions(), -1 if current is None else current)
    steps = store.checkpoint_steps()
    if step not in steps:
        raise ConfigError(f"{store.path} has no checkpoint of step {step} to {action}; it has steps {steps}")
    return step, current


def previous_promotion(rows: list[dict[str, Any]], current: int) -> int:
    """The step to roll back to from ``current``: the one promoted before it, where promotions
    stack up and a rollback takes off the steps above the one it returns to (so two rollbacks go
    two steps back, not back and forth)."""
    stack: list[int] = []
    for row in rows:
        step = int(row["step"])
        if row.get("action") == "promote":
            stack.append(step)
        elif row.get("action") == "rollback":
            while stack and stack[-1] != step:
                stack.pop()
            if not stack:
                stack.append(step)
    while stack and stack[-1] == current:
        stack.pop()
    if not stack:
        raise ConfigError(f"no step was promoted before step {current}; name the step to roll back to")
    return stack[-1]


def _log_batches(row: dict[str, Any], total: int) -> None:
    """A supervised run's progress, a line a batch."""
    validation = f", validation loss {row['sft/val_loss']:.4f}" if "sft/val_loss" in row else ""
    logger.info("sft batch %d/%d: loss %.4f%s", row["sft/batch"], total, row["sft/loss"], validation)
