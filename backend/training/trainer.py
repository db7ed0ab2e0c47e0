"""The GRPO LoRA trainer: groups of trajectories -> one optimizer step -> a checkpoint -> deployed.

One call to :meth:`Trainer.train` is one training step, in the paper's order::

    batch      = token-exact sequences of the groups (backend/training/batch.py)
    advantages = group-relative, per trajectory, shared by all its tokens (backend/training/loss.py)
    for each micro-batch (rows of sequences that share a prefix, packed by token budget):
        logprobs   = log pi_theta of the trained tokens      # chosen tokens only, chunked
        ratio      = exp(logprobs - sampling logprobs)       # against what vLLM sampled
        loss       = objective(ratio, advantages) aggregated over the whole batch
        loss.backward()
    clip the gradient norm; AdamW step
    checkpoints/<step:04d>/ written atomically (adapter, optimizer, trainer state)
    the adapter is deployed as <model>@<step> before the step is reported done

Checkpoints hold no pickle: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from journeyman.config import LoRAConfig, SFTConfig, TrainConfig
from journeyman.errors import ConfigError, InvalidDataError, MissingDependencyError
from journeyman.sft import check_conversations, split_eval
from journeyman.store import ModelStore
from journeyman.trajectory import Trajectory, TrajectoryGroup

from ..models import resolve_base_model
from .batch import Row, TrainSequence, build_batch, pack
from .logprobs import SequenceViews, packed_inputs, sequence_views, token_logprobs
from .loss import LOSSES, policy_loss
from .loss import advantages as group_advantages
from .memory import release_memory
from .metrics import StepTotals, data_metrics, zero_variance_groups
from .sft import SFTProgress, run_sft, sft_conversations

try:
    import torch
except ImportError as error:  # pragma: no cover - the train extra is missing
    raise MissingDependencyError("torch", "train", "the trainer") from error

from .checkpoints import ADAPTER, OPTIMIZER, STATE, checkpoint_tensors, read_optimizer, write_checkpoint
from .device import (
    bf16_supported,
    describe,
    parse_train_device,
    resolve_train_device,
    synchronize,
    training_dtype,
)
from .loading import TRAINING_ENGINES, load_transformers, load_unsloth, unsloth_chosen

__all__ = ["ADAPTER", "OPTIMIZER", "STATE", "StepResult", "Trainer", "bf16_supported"]

logger = logging.getLogger(__name__)

Deploy = Callable[[Path, int], Awaitable[Any]]
_T = TypeVar("_T")


@dataclass
class _Before:
    """A trainer's state before a step (:meth:`Trainer._before_step`)."""

    step: int
    learning_rate: float | None
    config: TrainConfig | None
    weights: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    optimizer_state: dict[Any, dict[str, torch.Tensor]] | None


@dataclass
class StepResult:
    step: int
    """The step the model is at after training (its adapter is served as ``<model>@<step>``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None


class Trainer:
    """Holds the model with its LoRA adapter and optimizer for one trainable model."""

    supports_sft = True
    """Supervised runs (:meth:`train_sft`) train in this one process."""

    def __init__(
        self,
        base_model: str | Path,
        store: ModelStore,
        *,
        lora: LoRAConfig | None = None,
        precision: str = "auto",
        threads: int | None = None,
        deploy: Deploy | None = None,
        engine: str = "auto",
        seed: int = 0,
        fused_lora: bool = True,
        device: str | torch.device = "auto",
        max_seq_length: int | None = None,
    ) -> None:
        self.base_model = base_model
        self.seed = seed
        self.fused_lora = fused_lora
        self.store = store
        self.lora = lora or LoRAConfig()
        self.precision = precision
        self.threads = threads
        self.deploy = deploy
        if engine not in TRAINING_ENGINES:
            raise ConfigError(f"engine must be auto, transformers or unsloth, got {engine!r}")
        self.engine = engine
        self.train_device = parse_train_device(device)
        """What it was asked to train on (``auto``, ``cpu``, ``cuda``, ``cuda:N``); :attr:`device`
        is the device that names on this machine."""
        self._device: torch.device | None = None
        self._unsloth: bool | None = None
        self.max_seq_length = max_seq_length or TrainConfig().max_seq_len
        """Unsloth only: the longest row it is loaded for (it cuts longer inputs); a step whose
        ``max_seq_len`` is larger is refused."""
        self.step = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._learning_rate: float | None = None
        self._config: TrainConfig | None = None  # the last step's, recorded in its checkpoint
        self._checkpoint_split = "train"  # the history split of the step a checkpoint saves
        self._worker: ThreadPoolExecutor | None = None
        """The one thread async steps run on (see :func:`release_memory`)."""

    # Loading and checkpoints -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device it trains on: the model, and every tensor a step makes, are there."""
        if self._device is None:
            self._device = resolve_train_device(self.train_device)
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The base weights' dtype: bf16 where the training device has it (fp32 by ``precision``)."""
        return training_dtype(self.precision, self.device)

    @property
    def uses_unsloth(self) -> bool:
        """Unsloth when asked for, or by default when training on CUDA where Unsloth imports."""
        if self._unsloth is None:
            self._unsloth = unsloth_chosen(self.engine, self.device)
        return self._unsloth

    def describe(self) -> str:
        """Engine, device and dtype, e.g. ``"transformers on cpu in bfloat16"``."""
        return describe("unsloth" if self.uses_unsloth else "transformers", self.device, self.dtype)

    def load(self) -> int:
        """Load the base model and the latest complete checkpoint (or create step 0); return the step."""
        if self.threads:
            torch.set_num_threads(self.threads)
        path = resolve_base_model(str(self.base_model))
        latest = self.store.latest_checkpoint()
        checkpoint = None if latest is None else latest[1]
        device = self.device
        if self.uses_unsloth:
            self.model, self.tokenizer = load_unsloth(
                path, checkpoint, dtype=self.dtype, lora=self.lora, seed=self.seed, device=device,
                max_seq_length=self.max_seq_length,
            )  # fmt: skip
        else:
            self.model, self.tokenizer = load_transformers(
                path, checkpoint, dtype=self.dtype, lora=self.lora, seed=self.seed, fused=self.fused_lora,
                device=device,
            )  # fmt: skip
        logger.info("training %s with %s", self.base_model, self.describe())
        for parameter in self.model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.float()  # LoRA weights and optimizer state in fp32
        embedding = self.model.get_base_model().get_input_embeddings().weight.numel()
        self._parameters = sum(p.numel() for p in self.model.parameters()) - embedding
        self.optimizer = None
        if latest is None:
            self.step = 0
            self._save_checkpoint(0)
            logger.info("created the step-0 adapter in %s", self.store.checkpoint_path(0))
        else:
            self.step = latest[0]
            self._load_optimizer(latest[1])
            logger.info("resumed from %s", latest[1])
            self._mend_interrupted_step(latest[1])
        return self.step

    def _mend_interrupted_step(self, checkpoint: Path) -> None:
        """Mend what a process that died between a step's parts left: the groups it stored for a
        step it never finished (never trained on) go to the split ``interrupted``, so the step's
        file holds only what it trains on; a checkpoint written without its history row (killed
        before the deploy ended) gets the row, from the metrics the checkpoint keeps."""
        store = self.store
        unfinished = store.trajectories_path("train", self.step)
        if unfinished.exists():
            kept = store.trajectories_path("interrupted", self.step)
            if kept.exists():  # an earlier move died halfway: add to it
                store.save_groups(store.load_groups("train", self.step), "interrupted", self.step)
                unfinished.unlink()
            else:
                kept.parent.mkdir(parents=True, exist_ok=True)
                os.replace(unfinished, kept)
            logger.warning(
                "step %d was interrupted before it trained: its stored groups are kept in %s", self.step, kept
            )
        trained = {row.get("step") for row in store.read_history() if row.get("split") in ("train", "sft")}
        if self.step > 0 and self.step not in trained:
            state = json.loads((checkpoint / STATE).read_text())
            split = state.get("split", "train")
            store.append_history(
                {"step": self.step, "split": split, **state.get("metrics", {}), "recovered": 1}
            )
            logger.warning(
                "step %d's history row was lost with its process: written from its checkpoint", self.step
            )

    def adapter_path(self, step: int | None = None) -> Path:
        return self.store.checkpoint_path(self.step if step is None else step) / ADAPTER

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def _optimizer(self, config: TrainConfig) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = [p for _, p in self._trainable()]
            self.optimizer = torch.optim.AdamW(
                params, lr=config.learning_rate, weight_decay=config.weight_decay
            )
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = config.learning_rate, config.weight_decay
        return self.optimizer

    def _save_checkpoint(self, step: int, metrics: dict[str, float] | None = None) -> Path:
        return self._write_checkpoint(step, metrics, *self._checkpoint_tensors())

    def _checkpoint_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The adapter's weights and the optimizer state, by parameter name."""
        return checkpoint_tensors(self._trainable(), self.optimizer)

    def _write_checkpoint(
        self,
        step: int,
        metrics: dict[str, float] | None,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
    ) -> Path:
        state = {
            "base_model": str(self.base_model),
            "lora": self.lora.model_dump(mode="json"),
            "learning_rate": self._learning_rate,
            # what decides which tokens were trained (the viewer marks them from this)
            "sequences": {"max_seq_len": self._config.max_seq_len, "overlong": self._config.overlong}
            if self._config is not None
            else None,
            "metrics": metrics or {},
            "split": self._checkpoint_split,
        }
        save = functools.partial(_save_adapter, self.model)
        return write_checkpoint(self.store, step, save, adapter, optimizer, state)

    def _load_optimizer(self, folder: Path) -> None:
        self._set_optimizer_state(*read_optimizer(folder))

    def _set_optimizer_state(
        self, tensors: dict[str, dict[str, torch.Tensor]], learning_rate: float | None
    ) -> None:
        """AdamW's state by parameter name (a checkpoint's, or rank 0's), each value put onto its
        parameter's device; AdamW keeps its step count on the CPU. Nothing to set: no optimizer yet."""
        if not tensors:
            return
        optimizer = self._optimizer(TrainConfig(learning_rate=learning_rate or 1e-5))
        for name, parameter in self._trainable():
            if name in tensors:
                optimizer.state[parameter] = {
                    key: value.to(parameter.device) if value.dim() else value
                    for key, value in tensors[name].items()
                }

    # One step ----------------------------------------------------------------------------------

    async def train(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | None = None) -> StepResult:
        """Train one step on ``groups``, checkpoint it, deploy it; the result carries the metrics."""
        config = config or TrainConfig()
        check_groups(groups)
        # The step's data is on disk before training; a step retried after a failure is stored once.
        stored = {group.id for group in self.store.load_groups("train", self.step)}
        self.store.save_groups([g for g in groups if g.id not in stored], "train", self.step)
        result = await self._on_worker(self.train_step, groups, config)
        await self._deploy_timed(result)
        self.store.append_history({"step": result.step, "split": "train", **result.metrics})
        return result

    async def _on_worker(self, step: Callable[..., _T], *args: Any) -> _T:
        """``step(*args)`` on the trainer's one thread, its memory given back after (see
        :func:`release_memory`)."""
        self._worker = self._worker or ThreadPoolExecutor(1, thread_name_prefix="journeyman-train")

        def released() -> _T:
            try:
                return step(*args)
            finally:
                release_memory(self.device)

        return await asyncio.get_running_loop().run_in_executor(self._worker, released)

    async def _deploy_timed(self, result: StepResult) -> None:
        """Deploy the step's checkpoint (where there is a deploy), timed as ``time/deploy``."""
        if self.deploy is not None and result.checkpoint is not None:
            start = time.perf_counter()
            await self.deploy(result.checkpoint / ADAPTER, result.step)
            result.metrics["time/deploy"] = time.perf_counter() - start

    def train_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> StepResult:
        if self.model is None:
            self.load()
        if self.threads:  # OpenMP settings are per thread: set them where the step runs
            torch.set_num_threads(self.threads)
        torch.manual_seed(config.seed + self.step)
        start = time.perf_counter()
        advantage, sequences, metrics = self._prepare(groups, config)
        timings = {"time/prepare": time.perf_counter() - start}
        before = self._before_step()
        try:
            self.step += 1
            self._learning_rate, self._config = config.learning_rate, config
            if not sequences:
                logger.warning(
                    "step %d: no trajectory with a reward spread to learn from; the adapter is unchanged",
                    self.step,
                )
            else:
                trained, times = self._update(sequences, advantage, config)
                metrics.update(trained)
                timings.update(times)
            metrics.update(timings)
            return StepResult(self.step, metrics, self._checkpoint_timed(metrics))
        except BaseException:
            # The step happens whole or not at all: whatever failed (a forward or backward pass,
            # the optimizer halfway through its parameters, the checkpoint's write), the trainer
            # is as it was before it, and the same call can be made again.
            self._undo_step(before, config)
            raise

    # One supervised step -------------------------------------------------------------------------

    async def train_sft(
        self,
        trajectories: Sequence[Trajectory],
        config: SFTConfig | None = None,
        evaluation: Sequence[Trajectory] | None = None,
        progress: SFTProgress | None = None,
    ) -> StepResult:
        """Train the adapter on ``trajectories``' model turns (:mod:`.sft`), checkpoint it as the
        next step, deploy it; the history gets a row per batch (``sft_batch``) and the step's
        ``sft`` row. ``evaluation``: conversations for the validation loss (default: drawn by
        ``config.eval_fraction``). Bad data raises before anything trains; a failure leaves the
        trainer as it was, nothing deployed."""
        config = config or SFTConfig()
        if not self.supports_sft:
            raise ConfigError(
                "supervised training runs in one process: train_sft on a trainer without data parallelism"
            )
        trajectories = list(trajectories)
        check_conversations(trajectories)
        if evaluation is not None:
            evaluation = list(evaluation)
            check_conversations(evaluation, "the evaluation conversations")
        else:
            trajectories, evaluation = split_eval(trajectories, config.eval_fraction, config.seed)
        result, rows = await self._on_worker(self.sft_step, trajectories, evaluation, config, progress)
        # What it learned from, beside the groups RL steps keep (the viewer and journeyman check read them).
        self.store.save_groups([TrajectoryGroup(trajectories)], "sft", result.step - 1)
        if evaluation:
            self.store.save_groups([TrajectoryGroup(evaluation)], "sft_eval", result.step - 1)
        await self._deploy_timed(result)
        for row in rows:
            self.store.append_history({"step": result.step, **row})
        self.store.append_history({"step": result.step, "split": "sft", **result.metrics})
        return result

    def sft_step(
        self,
        trajectories: list[Trajectory],
        evaluation: list[Trajectory],
        config: SFTConfig,
        progress: SFTProgress | None = None,
    ) -> tuple[StepResult, list[dict[str, Any]]]:
        """The supervised run, whole or not at all (as :meth:`train_step`); its result and rows."""
        if self.model is None:
            self.load()
        if self.threads:
            torch.set_num_threads(self.threads)
        torch.manual_seed(config.seed + self.step)
        counts: Counter[str] = Counter()
        context = int(getattr(self.model.get_base_model().config, "max_position_embeddings", None) or 1 << 30)
        train = sft_conversations(trajectories, self.tokenizer, config, context, counts)
        held = sft_conversations(evaluation, self.tokenizer, config, context, Counter()) if evaluation else []
        before = self._before_step()
        try:
            self.step += 1
            self._learning_rate = config.learning_rate
            metrics, rows = run_sft(self, train, held, config, progress)
            metrics.update({key: float(value) for key, value in counts.items()})
            self._checkpoint_split = "sft"
            try:
                path = self._checkpoint_timed(metrics)
            finally:
                self._checkpoint_split = "train"
            return StepResult(self.step, metrics, path), rows
        except BaseException:
            self._undo_step(before, config)
            raise

    def _before_step(self) -> _Before:
        """What a failed step puts back: the step counter, the learning rate and config the last
        checkpoint records, and copies of the LoRA weights and the optimizer state (small next to
        the base model: a rank-8 adapter of a 1.5B model and its AdamW moments are ~110 MB)."""
        state = None
        if self.optimizer is not None:
            state = {
                parameter: {key: value.detach().clone() for key, value in values.items()}
                for parameter, values in self.optimizer.state.items()
            }
        weights = {name: p.detach().clone() for name, p in self._trainable()}
        return _Before(self.step, self._learning_rate, self._config, weights, self.optimizer, state)

    def _undo_step(self, before: _Before, config: TrainConfig | SFTConfig) -> None:
        """Put back what :meth:`_before_step` kept, drop the step's gradients and turn activation
        checkpointing off again."""
        self.step, self._learning_rate, self._config = before.step, before.learning_rate, before.config
        with torch.no_grad():
            for name, parameter in self._trainable():
                parameter.copy_(before.weights[name])
                parameter.grad = None
        self.optimizer = before.optimizer
        if self.optimizer is not None and before.optimizer_state is not None:
            self.optimizer.state.clear()
            self.optimizer.state.update(before.optimizer_state)
        if config.gradient_checkpointing:
            self._checkpoint_activations(False)
        logger.warning(
            "step %d failed; the trainer is back at step %d, as before it", before.step + 1, before.step
        )

    def _prepare(
        self, groups: Sequence[TrajectoryGroup], config: TrainConfig
    ) -> tuple[torch.Tensor, list[TrainSequence], dict[str, float]]:
        """The step's advantages, the sequences worth training (those whose group's rewards
        differ) and the data's metrics."""
        batch = build_batch(groups, self.tokenizer, config)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        group_ids = torch.tensor(batch.groups, dtype=torch.long)
        if rewards.numel():
            advantage, informative = group_advantages(rewards, group_ids, config.effective_scale_rewards)
        else:
            advantage, informative = rewards, rewards.bool()
        zero_variance = zero_variance_groups(batch, informative)
        sequences = [s for s in batch.sequences if informative[s.trajectory]]
        return advantage, sequences, data_metrics(batch, zero_variance, sequences)

    def _update(
        self, sequences: list[TrainSequence], advantage: torch.Tensor, config: TrainConfig
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Forward and backward over the micro-batches, then one clipped optimizer step; the
        training metrics, and the timings."""
        totals, grad_norm, timings = self._device_step(sequences, advantage, config)
        (norm,) = totals.gather(grad_norm)  # the step's one wait for the device's numbers
        metrics = {**totals.metrics(), "train/grad_norm": norm, "train/learning_rate": config.learning_rate}
        return metrics, timings

    def _device_step(
        self, sequences: list[TrainSequence], advantage: torch.Tensor, config: TrainConfig
    ) -> tuple[StepTotals, torch.Tensor, dict[str, float]]:
        """The step's tensor work, all of it on :attr:`device` and none of it waiting for the
        device's numbers (a GPU runs ahead of the host): the micro-batches' forward and backward
        passes, the gradient's clipping and the optimizer step. The running totals, the gradient
        norm (a tensor on the device) and the timings."""
        if config.max_seq_len > self.max_seq_length and self.uses_unsloth:
            raise ConfigError(
                f"max_seq_len={config.max_seq_len}, but Unsloth was loaded for rows of at most "
                f"{self.max_seq_length} tokens: create the trainer with max_seq_length={config.max_seq_len}"
            )
        optimizer = self._optimizer(config)
        self.model.train()
        if config.gradient_checkpointing:
            self._checkpoint_activations(True)
        totals = StepTotals(sequences)
        advantage = advantage.to(self.device, non_blocking=True)
        start = time.perf_counter()
        for rows, trains in self._micro_batches(sequences, config):
            self._forward_backward(rows, advantage, config, totals, trains)
        synchronize(self.device)
        forward_backward = time.perf_counter() - start

        start = time.perf_counter()
        params = [p for _, p in self._trainable()]
        self._synchronise(params, totals)
        max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        optimizing = time.perf_counter() - start
        if config.gradient_checkpointing:
            self._checkpoint_activations(False)
        return totals, grad_norm, {"time/forward_backward": forward_backward, "time/optimizer": optimizing}

    def _checkpoint_activations(self, on: bool) -> None:
        """Recompute each layer's activations in the backward pass (``gradient_checkpointing``).
        Unsloth checkpoints its own way, from its load on; transformers 5.23 and newer name it
        ``activation_checkpointing_*``, older ones (Unsloth's pins) ``gradient_checkpointing_*``."""
        if self.uses_unsloth:
            return
        model = self.model
        if hasattr(model, "activation_checkpointing_enable"):
            if on:
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                model.activation_checkpointing_disable()
        elif on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        if on:
            model.enable_input_require_grads()

    def _micro_batches(
        self, sequences: list[TrainSequence], config: TrainConfig
    ) -> list[tuple[list[Row], bool]]:
        """This process's packed micro-batches, each with whether it trains: data parallel trains a
        share, and under FSDP adds passes that train nothing so that every rank runs as many."""
        # Unsloth drops the tree mask in training: there a row holds one sequence
        rows = pack(
            self._local_share(sequences),
            config.micro_batch_tokens,
            self._row_cost,
            share_prefix=not self.uses_unsloth,
        )
        return [(micro_batch, True) for micro_batch in rows]

    def _local_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """The sequences this process trains on (all of them; data parallel trains a share)."""
        return sequences

    def _synchronise(self, params: list[torch.nn.Parameter], totals: StepTotals) -> None:
        """Combine the gradients and step totals of all processes (nothing to do alone)."""

    def _checkpoint_timed(self, metrics: dict[str, float]) -> Path:
        """The step's checkpoint; the step is not done until it is on disk (a failed write undoes
        the step, :meth:`train_step`)."""
        start = time.perf_counter()
        path = self._save_checkpoint(self.step, metrics)
        metrics["time/checkpoint"] = time.perf_counter() - start
        return path

    def _row_cost(self, tokens: int) -> float:
        """Forward FLOPs of one packed row: 2 per parameter per token for the linear layers, and
        ~4 x hidden x layers per pair of tokens for attention (the tree mask is dense)."""
        config = self.model.get_base_model().config
        attention = 4 * config.hidden_size * config.num_hidden_layers
        return float(tokens * (2 * self._parameters + attention * tokens))

    def _forward_backward(
        self,
        rows: list[Row],
        advantage: torch.Tensor,
        config: TrainConfig,
        totals: StepTotals,
        trains: bool = True,
    ) -> None:
        device = self.device
        inputs = packed_inputs(rows, self.tokenizer.pad_token_id or 0, device)
        micro_batch = [s for row in rows for s in row.sequences]
        views: SequenceViews = sequence_views(micro_batch, inputs.where, device)
        trajectories = torch.tensor([s.trajectory for s in micro_batch]).to(device, non_blocking=True)
        seq_advantage = advantage[trajectories]  # (B,)

        logprobs, entropy = token_logprobs(self.model, inputs, views, config.logprob_chunk)
        reference = None
        if config.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                reference, _ = token_logprobs(self.model, inputs, views, config.logprob_chunk)
        parts = policy_loss(
            config.loss,
            logprobs,
            views.sampling,
            views.mask,
            seq_advantage,
            epsilon=config.effective_epsilon,
            epsilon_high=config.effective_epsilon_high,
            max_tokens=config.max_tokens,
            mismatch=config.mismatch,
            mismatch_threshold=config.mismatch_threshold,
            beta=config.beta,
            reference_logprobs=reference,
            live=views.live,
        )
        # The loss is a mean over the micro-batch; weight it by the micro-batch's share of the
        # whole batch's denominator so the accumulated gradient is the full batch's gradient.
        aggregation = LOSSES[config.loss].aggregation
        weight = totals.share(views.tokens, views.live.numel(), aggregation) if trains else 0.0
        (parts.loss * weight).backward()  # type: ignore[no-untyped-call]
        if trains:
            totals.add(parts, weight, views.tokens, logprobs.detach(), views.sampling, views.mask, entropy)


def check_groups(groups: Sequence[TrajectoryGroup]) -> None:
    """Refuse input that is not a list of groups, with a message that says what to pass."""
    if isinstance(groups, TrajectoryGroup) or not all(isinstance(g, TrajectoryGroup) for g in groups):
        raise InvalidDataError("train() takes a list of TrajectoryGroup (one per scenario)")
    if not groups:
        raise ConfigError("train() needs at least one group")


def _save_adapter(model: Any, folder: Path, weights: dict[str, torch.Tensor]) -> None:
    model.save_pretrained(folder, state_dict=weights)
