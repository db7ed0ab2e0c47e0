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
import contextlib
import ctypes
import errno
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from journeyman.config import LoRAConfig, TrainConfig
from journeyman.errors import ConfigError, InvalidDataError, MissingDependencyError
from journeyman.store import CHECKPOINT_STATE, ModelStore
from journeyman.trajectory import TrajectoryGroup

from ..models import resolve_base_model
from .batch import Batch, Row, TrainSequence, build_batch, pack
from .loss import LOSSES, policy_loss
from .loss import advantages as group_advantages

try:
    import torch
    from torch.utils.checkpoint import checkpoint
except ImportError as error:  # pragma: no cover - the train extra is missing
    raise MissingDependencyError("torch", "train", "the trainer") from error

from . import fused_lora  # after the torch check

__all__ = ["StepResult", "Trainer"]

logger = logging.getLogger(__name__)

ADAPTER = "adapter"
OPTIMIZER = "optimizer.safetensors"
STATE = CHECKPOINT_STATE

Deploy = Callable[[Path, int], Awaitable[Any]]


@dataclass
class StepResult:
    step: int
    """The step the model is at after training (its adapter is served as ``<model>@<step>``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None


def bf16_supported() -> bool:
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


class Trainer:
    """Holds the model with its LoRA adapter and optimizer for one trainable model."""

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
    ) -> None:
        self.base_model = base_model
        self.seed = seed
        self.fused_lora = fused_lora
        self.store = store
        self.lora = lora or LoRAConfig()
        self.precision = precision
        self.threads = threads
        self.deploy = deploy
        if engine not in ("auto", "transformers", "unsloth"):
            raise ConfigError(f"engine must be auto, transformers or unsloth, got {engine!r}")
        self.engine = engine
        self.step = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._learning_rate: float | None = None
        self._worker: ThreadPoolExecutor | None = None
        """The one thread async steps run on (see :func:`release_memory`)."""

    # Loading and checkpoints -------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        if self.precision == "fp32" or (self.precision == "auto" and not bf16_supported()):
            return torch.float32
        return torch.bfloat16

    @property
    def uses_unsloth(self) -> bool:
        """Unsloth when asked for, or by default where CUDA and Unsloth are both present."""
        if self.engine == "unsloth":
            if not (torch.cuda.is_available() and importlib.util.find_spec("unsloth")):
                raise ConfigError("engine='unsloth' needs a CUDA GPU and `pip install 'journeyman[unsloth]'`")
            return True
        return (
            self.engine == "auto"
            and torch.cuda.is_available()
            and importlib.util.find_spec("unsloth") is not None
        )

    def load(self) -> int:
        """Load the base model and the latest complete checkpoint (or create step 0); return the step."""
        if self.threads:
            torch.set_num_threads(self.threads)
        path = resolve_base_model(str(self.base_model))
        latest = self.store.latest_checkpoint()
        if self.uses_unsloth:
            self._load_unsloth(path, latest)
        else:
            self._load_transformers(path, latest)
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
        return self.step

    def _peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,  # type: ignore[arg-type]  # peft accepts floats
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.effective_target_modules),
            task_type="CAUSAL_LM",
        )

    def _load_transformers(self, path: Path | str, latest: tuple[int, Path] | None) -> None:
        from peft import PeftModel, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        if latest is None:
            with torch.random.fork_rng(devices=[]):  # the same initial adapter for the same seed
                torch.manual_seed(self.seed)
                self.model = get_peft_model(base, self._peft_config())
        else:
            self.model = PeftModel.from_pretrained(base, latest[1] / ADAPTER, is_trainable=True)
        if self.fused_lora:
            fused_lora.install(self.model)

    def _load_unsloth(
        self, path: Path | str, latest: tuple[int, Path] | None
    ) -> None:  # pragma: no cover - GPU only
        """Unsloth's fused kernels on CUDA; the same peft adapter format on disk."""
        from unsloth import FastLanguageModel

        source = str(latest[1] / ADAPTER) if latest is not None else str(path)
        model, self.tokenizer = FastLanguageModel.from_pretrained(
            model_name=source, dtype=self.dtype, load_in_4bit=False
        )
        if latest is None:
            lora = self.lora
            model = FastLanguageModel.get_peft_model(
                model,
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.effective_target_modules),
            )
        FastLanguageModel.for_training(model)
        self.model = model

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
        adapter = {name: p.detach() for name, p in self._trainable()}
        optimizer: dict[str, torch.Tensor] = {}
        if self.optimizer is not None:
            index = {id(p): name for name, p in self._trainable()}
            for parameter, state in self.optimizer.state.items():
                for key, value in state.items():
                    optimizer[f"{index[id(parameter)]}/{key}"] = torch.as_tensor(value).detach().clone()
        return adapter, optimizer

    def _write_checkpoint(
        self,
        step: int,
        metrics: dict[str, float] | None,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
    ) -> Path:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        with self.store.write_checkpoint(step) as folder:
            try:
                self.model.save_pretrained(folder / ADAPTER, state_dict=adapter)
                tensors = {"rng/torch": torch.get_rng_state()}
                tensors |= {key: value.contiguous() for key, value in optimizer.items()}
                save_file(tensors, str(folder / OPTIMIZER))
            except SafetensorError as error:
                raise _os_error(error) from error
            state = {
                "step": step,
                "base_model": str(self.base_model),
                "lora": self.lora.model_dump(mode="json"),
                "learning_rate": self._learning_rate,
                "metrics": metrics or {},
            }
            (folder / STATE).write_text(json.dumps(state, indent=2) + "\n")
        return self.store.checkpoint_path(step)

    def _load_optimizer(self, folder: Path) -> None:
        from safetensors.torch import load_file

        tensors = load_file(str(folder / OPTIMIZER))
        if "rng/torch" in tensors:
            torch.set_rng_state(tensors.pop("rng/torch"))
        if not tensors:
            return
        state = json.loads((folder / STATE).read_text())
        optimizer = self._optimizer(TrainConfig(learning_rate=state.get("learning_rate") or 1e-5))
        for name, parameter in self._trainable():
            keys = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.split("/", 1)[0] == name}
            if keys:
                optimizer.state[parameter] = keys

    # One step ----------------------------------------------------------------------------------

    async def train(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | None = None) -> StepResult:
        """Train one step on ``groups``, checkpoint it, deploy it; the result carries the metrics."""
        config = config or TrainConfig()
        check_groups(groups)
        # The step's data is on disk before training; a step retried after a failure is stored once.
        stored = {group.id for group in self.store.load_groups("train", self.step)}
        self.store.save_groups([g for g in groups if g.id not in stored], "train", self.step)
        self._worker = self._worker or ThreadPoolExecutor(1, thread_name_prefix="journeyman-train")
        result = await asyncio.get_running_loop().run_in_executor(
            self._worker, self._released_step, groups, config
        )
        if self.deploy is not None and result.checkpoint is not None:
            start = time.perf_counter()
            await self.deploy(result.checkpoint / ADAPTER, result.step)
            result.metrics["time/deploy"] = time.perf_counter() - start
        self.store.append_history({"step": result.step, "split": "train", **result.metrics})
        return result

    def _released_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> StepResult:
        try:
            return self.train_step(groups, config)
        finally:
            release_memory()

    def train_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig) -> StepResult:
        if self.model is None:
            self.load()
        if self.threads:  # OpenMP settings are per thread: set them where the step runs
            torch.set_num_threads(self.threads)
        torch.manual_seed(config.seed + self.step)
        timings: dict[str, float] = {}
        start = time.perf_counter()
        batch = build_batch(groups, self.tokenizer, config)
        rewards = torch.tensor(batch.rewards, dtype=torch.float32)
        group_ids = torch.tensor(batch.groups, dtype=torch.long)
        if rewards.numel():
            advantage, informative = group_advantages(rewards, group_ids, config.effective_scale_rewards)
        else:
            advantage, informative = rewards, rewards.bool()
        zero_variance = _zero_variance_groups(batch, informative)
        sequences = [s for s in batch.sequences if informative[s.trajectory]]
        metrics = _data_metrics(batch, zero_variance, sequences)
        timings["time/prepare"] = time.perf_counter() - start

        self.step += 1
        self._learning_rate = config.learning_rate
        if not sequences:
            logger.warning(
                "step %d: no trajectory with a reward spread to learn from; the adapter is unchanged",
                self.step,
            )
            metrics.update(timings)
            return StepResult(self.step, metrics, self._checkpoint_timed(metrics))

        optimizer = self._optimizer(config)
        self.model.train()
        if config.gradient_checkpointing:
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
            self.model.enable_input_require_grads()
        totals = StepTotals(sequences)
        start = time.perf_counter()
        for rows, trains in self._micro_batches(sequences, config):
            self._forward_backward(rows, advantage, config, totals, trains)
        timings["time/forward_backward"] = time.perf_counter() - start

        start = time.perf_counter()
        params = [p for _, p in self._trainable()]
        self._synchronise(params, totals)
        max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timings["time/optimizer"] = time.perf_counter() - start
        if config.gradient_checkpointing:
            self.model.activation_checkpointing_disable()

        metrics.update(totals.metrics())
        metrics["train/grad_norm"] = float(grad_norm)
        metrics["train/learning_rate"] = config.learning_rate
        metrics.update(timings)
        return StepResult(self.step, metrics, self._checkpoint_timed(metrics))

    def _micro_batches(
        self, sequences: list[TrainSequence], config: TrainConfig
    ) -> list[tuple[list[Row], bool]]:
        """This process's packed micro-batches, each with whether it trains: data parallel trains a
        share, and under FSDP adds passes that train nothing so that every rank runs as many."""
        rows = pack(self._local_share(sequences), config.micro_batch_tokens, self._row_cost)
        return [(micro_batch, True) for micro_batch in rows]

    def _local_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """The sequences this process trains on (all of them; data parallel trains a share)."""
        return sequences

    def _synchronise(self, params: list[torch.nn.Parameter], totals: StepTotals) -> None:
        """Combine the gradients and step totals of all processes (nothing to do alone)."""

    def _checkpoint_timed(self, metrics: dict[str, float]) -> Path:
        start = time.perf_counter()
        try:
            path = self._save_checkpoint(self.step, metrics)
        except BaseException:
            # The step is not done until it is on disk: count it undone, and have the next step
            # reload the last checkpoint rather than build on weights that were never saved.
            self.step -= 1
            self.model = None
            raise
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
        inputs = _packed_inputs(rows, self.tokenizer.pad_token_id or 0)
        micro_batch = [s for row in rows for s in row.sequences]
        where, targets, mask, sampling = _sequence_views(micro_batch, inputs.where)
        seq_advantage = advantage[torch.tensor([s.trajectory for s in micro_batch])]  # (B,)

        logprobs, entropy = self._token_logprobs(inputs, where, targets, mask, config.logprob_chunk)
        reference = None
        if config.beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                reference, _ = self._token_logprobs(inputs, where, targets, mask, config.logprob_chunk)
        parts = policy_loss(
            config.loss,
            logprobs,
            sampling,
            mask,
            seq_advantage,
            epsilon=config.effective_epsilon,
            epsilon_high=config.effective_epsilon_high,
            max_tokens=config.max_tokens,
            mismatch=config.mismatch,
            mismatch_threshold=config.mismatch_threshold,
            beta=config.beta,
            reference_logprobs=reference,
        )
        # The loss is a mean over the micro-batch; weight it by the micro-batch's share of the
        # whole batch's denominator so the accumulated gradient is the full batch's gradient.
        weight = totals.share(mask, LOSSES[config.loss].aggregation) if trains else 0.0
        (parts.loss * weight).backward()  # type: ignore[no-untyped-call]
        if trains:
            totals.add(parts, weight, logprobs.detach(), sampling, mask, entropy)

    def _token_logprobs(
        self,
        inputs: _PackedInputs,
        where: torch.Tensor,
        targets: torch.Tensor,
        mask: torch.Tensor,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs (with gradient) and entropies (detached) of the masked target tokens, (B, T-1).

        One forward pass over the packed rows; logits are computed only at trained positions and
        ``chunk`` positions at a time, each chunk recomputed in the backward pass, so the
        full-vocabulary logits of the batch are never held in memory at once.
        """
        causal_lm = self.model.get_base_model()
        hidden = causal_lm.get_decoder()(
            input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=inputs.attention
        ).last_hidden_state  # (R, W, H)
        positions = mask.bool()
        chosen_hidden = hidden.flatten(0, 1)[where[positions]]  # (N, H)
        chosen_targets = targets[positions]  # (N,)
        head = causal_lm.get_output_embeddings()
        frozen_head = type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad
        pieces, entropies = [], []
        for start in range(0, chosen_targets.numel(), chunk):
            piece = chosen_hidden[start : start + chunk], chosen_targets[start : start + chunk]
            if frozen_head:
                logprob, entropy = _ChosenLogprobs.apply(*piece, head.weight)  # type: ignore[no-untyped-call]
            else:  # a trained head: let autograd see it, recomputing the chunk's logits in backward
                logprob, entropy = checkpoint(_chunk_logprobs, *piece, head, use_reentrant=False)
            pieces.append(logprob)
            entropies.append(entropy)
        flat = torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
        logprobs = torch.zeros(mask.shape, dtype=torch.float32).masked_scatter(positions, flat)
        entropy = torch.zeros(mask.shape, dtype=torch.float32)
        if entropies:
            entropy = entropy.masked_scatter(positions, torch.cat(entropies))
        return logprobs, entropy


@dataclass
class _PackedInputs:
    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    attention: torch.Tensor  # (R, 1, W, W) bool, True where a query may attend to a key
    where: list[list[int]]
    """For each sequence of the micro-batch (rows in order), the flat index (row * W + column)
    of each of its tokens."""


def _sequence_views(
    sequences: list[TrainSequence], where: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T-1) per-sequence views for the loss: the packed index of the position that predicts
    each target, the targets, the trained-token mask and the sampling logprobs. Token t is
    predicted from position t-1, so targets and their masks are shifted by one."""
    width = max(len(s) for s in sequences)
    index = torch.zeros((len(sequences), width), dtype=torch.long)
    targets = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.float32)
    sampling = torch.full((len(sequences), width), math.nan, dtype=torch.float32)
    for b, (sequence, places) in enumerate(zip(sequences, where, strict=True)):
        n = len(sequence)
        index[b, :n] = torch.tensor(places)
        targets[b, :n] = torch.tensor(sequence.tokens)
        mask[b, :n] = torch.tensor(sequence.mask, dtype=torch.float32)
        sampling[b, :n] = torch.tensor(sequence.sampling_logprobs, dtype=torch.float32)
    return index[:, :-1], targets[:, 1:], mask[:, 1:], sampling[:, 1:]


def _packed_inputs(rows: list[Row], pad: int) -> _PackedInputs:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # Padding attends to itself only, so no query row is fully masked (that gives NaN).
    segment = torch.arange(width).repeat(len(rows), 1)  # (R, W)
    prefix = torch.zeros((len(rows), 1, 1), dtype=torch.long)
    where: list[list[int]] = []
    for r, row in enumerate(rows):
        tokens, positions, segments, index = row.layout()
        n = len(tokens)
        input_ids[r, :n] = torch.tensor(tokens)
        position_ids[r, :n] = torch.tensor(positions)
        segment[r, :n] = torch.tensor(segments)
        prefix[r] = row.prefix
        where += [[r * width + i for i in sequence] for sequence in index]
    q = torch.arange(width)[:, None]  # (W, 1)
    k = torch.arange(width)[None, :]  # (1, W)
    attention = (k <= q) & ((k >= segment[:, :, None]) | (k < prefix))  # (R, W, W)
    return _PackedInputs(input_ids, position_ids, attention[:, None], where)


def _os_error(error: Exception) -> OSError:
    """The OSError behind a failed safetensors write: it reports one (a full disk, measured: "I/O
    error: No space left on device (os error 28)") as a SafetensorError, which the store's
    handling of failed writes would not recognise."""
    found = re.search(r"os error (\d+)", str(error))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code))


def release_memory() -> None:
    """Hand the memory a step freed back to the OS (glibc ``malloc_trim``).

    glibc keeps freed memory in the arena of the thread that freed it. Steps run on worker
    threads, and a step's activations are gigabytes: with each step on another thread, the demo's
    process grew by 1-3 GB per step until it was OOM-killed at 17.8 GB (step 7). One worker
    thread per trainer and a trim after each step keep it at one step's peak.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class _ChosenLogprobs(torch.autograd.Function):
    """log softmax(h W^T)[target] and the entropy for a chunk of positions, through a frozen
    output layer W. Nothing of vocabulary size is kept for backward: the logits are recomputed
    there and turned into their gradient in place, (onehot(target) - softmax) x grad."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (hidden @ weight.t()).float()  # (n, V)
        lse = logits.logsumexp(-1)  # (n,)
        chosen = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        logits.sub_(lse[:, None])  # now log-probabilities
        entropy = -(logits.exp() * logits).sum(-1)
        ctx.save_for_backward(hidden, targets, weight, lse)
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, lse = ctx.saved_tensors
        logits = (hidden @ weight.t()).float()
        grad_logits = logits.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax x grad
        grad_logits[torch.arange(len(targets)), targets] += grad
        return grad_logits.to(hidden.dtype) @ weight, None, None


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # (n, V)
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy.detach()


def _zero_variance_groups(batch: Batch, informative: torch.Tensor) -> int:
    groups = {g for g, keep in zip(batch.groups, informative.tolist(), strict=True) if not keep}
    return len(groups)


def _data_metrics(batch: Batch, zero_variance: int, sequences: list[TrainSequence]) -> dict[str, float]:
    metrics = {key: float(value) for key, value in batch.counts.items()}
    groups = batch.counts["data/groups"]
    metrics["data/zero_variance_groups"] = float(zero_variance)
    metrics["data/zero_variance_share"] = zero_variance / groups if groups else 0.0
    metrics["data/sequences"] = float(len(sequences))
    metrics["data/trained_tokens"] = float(sum(s.trained_tokens for s in sequences))
    if batch.rewards:
        rewards = torch.tensor(batch.rewards)
        metrics["reward/mean"] = float(rewards.mean())
        metrics["reward/std"] = float(rewards.std(unbiased=False))
    return metrics


class StepTotals:
    """The batch-level denominators and the running sums for the step's metrics. Processes that
    share a step add their :meth:`sums` together and take the largest :attr:`max_ratio`."""

    SUMMED = ("loss", "policy", "kl", "clipped", "entropy", "masked", "known", "mismatch_k1", "micro_batches")

    def __init__(self, sequences: list[TrainSequence]) -> None:
        # Targets are shifted by one, so a sequence's first token is never a target.
        self.tokens = sum(sum(s.mask[1:]) for s in sequences)
        self.live_sequences = sum(1 for s in sequences if sum(s.mask[1:]) > 0)
        self.loss = self.policy = self.kl = 0.0
        self.clipped = self.entropy = self.masked = 0.0
        self.known = 0
        self.mismatch_k1 = 0.0
        self.max_ratio = 1.0
        self.micro_batches = 0

    def share(self, mask: torch.Tensor, aggregation: str) -> float:
        if aggregation == "token_mean":
            return float(mask.sum()) / max(1, self.tokens)
        return float((mask.sum(-1) > 0).sum()) / max(1, self.live_sequences)

    def add(
        self,
        parts: Any,
        weight: float,
        logprobs: torch.Tensor,
        sampling: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor,
    ) -> None:
        tokens = float(mask.sum())
        self.micro_batches += 1
        self.loss += float(parts.loss.detach()) * weight
        self.policy += float(parts.policy) * weight
        if parts.kl is not None:
            self.kl += float(parts.kl) * weight
        self.clipped += float(parts.clip_fraction) * tokens
        self.masked += float(parts.masked_by_mismatch)
        self.entropy += float((entropy * mask).sum())
        known = mask.bool() & ~torch.isnan(sampling)
        if known.any():
            delta = sampling[known] - logprobs[known]  # log mu - log pi on tokens sampled from mu
            self.known += int(known.sum())
            self.mismatch_k1 += float(delta.sum())
            self.max_ratio = max(self.max_ratio, float(torch.exp(delta.abs()).max()))

    def sums(self) -> list[float]:
        """The running sums, in :attr:`SUMMED` order."""
        return [float(getattr(self, key)) for key in self.SUMMED]

    def set_sums(self, values: Sequence[float]) -> None:
        """Replace the running sums (all processes' together), in :attr:`SUMMED` order."""
        for key, value in zip(self.SUMMED, values, strict=True):
            setattr(self, key, type(getattr(self, key))(value))

    def metrics(self) -> dict[str, float]:
        tokens = max(1, self.tokens)
        result = {
            "train/loss": self.loss,
            "train/policy_loss": self.policy,
            "train/clip_fraction": self.clipped / tokens,
            "train/entropy": self.entropy / tokens,
            "train/micro_batches": float(self.micro_batches),
            "mismatch/masked_tokens": self.masked,
            "mismatch/tokens_with_sampling_logprobs": float(self.known),
        }
        if self.kl:
            result["train/kl"] = self.kl
        if self.known:
            result["mismatch/kl"] = self.mismatch_k1 / self.known
            result["mismatch/max_ratio"] = self.max_ratio
        return result


def check_groups(groups: Sequence[TrajectoryGroup]) -> None:
    """Refuse input that is not a list of groups, with a message that says what to pass."""
    if isinstance(groups, TrajectoryGroup) or not all(isinstance(g, TrajectoryGroup) for g in groups):
        raise InvalidDataError("train() takes a list of TrajectoryGroup (one per scenario)")
    if not groups:
        raise ConfigError("train() needs at least one group")
