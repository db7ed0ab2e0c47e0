"""How one GPU is shared by the policy's vLLM server, a judge's vLLM server and the trainer.

vLLM takes the share of the GPU it is given (``--gpu-memory-utilization``) when it starts, checks
that this much is free, and fills what its weights and activations leave of it with KV cache.
Several processes on one GPU therefore need shares that add up to less than the whole, with room
left for the trainer. :func:`plan_gpu_memory` derives them from the GPU's size and the models'
shapes (read from their ``config.json``); :class:`GpuMemoryPlan` prints as a table and says what to
change when the parts do not fit. All sizes are bytes, estimated without loading anything:

- a vLLM server needs its weights (parameters x 2 bytes in bf16), a KV cache for ``sequences``
  sequences of ``max_model_len`` tokens (2 x layers x KV heads x head dim x 2 bytes per token), and
  :data:`VLLM_OVERHEAD` plus the activations of vLLM's profiling batch (its default batch: 8192
  tokens and 1024 sequences on cards of 70 GiB or more, else 2048 and 256): tokens x (hidden +
  2 x intermediate) x 2 bytes for the layers, sequences x vocabulary x 8 bytes for the sampler's
  fp32 logits and probabilities. Its share is that sum over the GPU's size, rounded up to 0.01,
  unless ``VLLMConfig.gpu_memory_utilization`` names one.
- the trainer holds its own bf16 copy of the base weights, the LoRA parameters in fp32 with their
  gradients and AdamW's two moments (16 bytes per parameter), :data:`TRAINER_OVERHEAD`, and the
  activations of one micro-batch of ``tokens`` tokens (``TrainConfig.micro_batch_tokens``). A
  Llama/Qwen decoder layer keeps about ``2 x (12 x hidden + 4 x intermediate)`` bytes per token for
  the backward pass: its two norms' inputs and outputs, q/k/v before and after RoPE, the attention
  output and statistics (together about 12 x hidden), and gate, up, SiLU(gate) and their product
  (4 x intermediate). With gradient checkpointing a layer keeps only its input (2 x hidden bytes
  per token) and one layer at a time is recomputed in full. The output layer adds
  ``logprob_chunk`` (512) positions x vocabulary x 12 bytes (fp32 logits, their log-softmax and its
  gradient). Attention is assumed to store no token x token matrix (SDPA's memory-efficient
  kernel).

Sleep mode (vLLM's ``--enable-sleep-mode``, CUDA only): while the trainer steps, the policy's server
sleeps at level 1, which copies its weights to CPU memory and drops its KV cache; what it keeps is
its overhead (CUDA context, CUDA graphs, the allocator's pool). The plan then has two moments: while
serving, the servers' shares beside the trainer's resident part (weights, LoRA state, overhead: the
trainer hands its cached activation blocks back after each step); while training, the sleeping
server's overhead, the other servers' shares and the whole trainer. A judge's server does not
sleep. The trainer keeps bf16 base weights: 4-bit (QLoRA) training is not supported, so a 7-8B
policy does not fit a 24 GB card.

``python -m journeyman.backend.serving.gpu_memory`` prints what fits on common cards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from journeyman.errors import ConfigError

__all__ = [
    "CARDS",
    "FALLBACK_UTILIZATION",
    "Card",
    "GpuMemoryPlan",
    "ModelShape",
    "ServerSpec",
    "TrainerSpec",
    "fit_table",
    "model_shape",
    "plan_gpu_memory",
    "visible_gpu_memory",
]

GiB = 1024**3
MiB = 1024**2

VLLM_OVERHEAD = int(1.5 * GiB)
"""A vLLM server's memory beside its weights, KV cache and profiled activations: the CUDA context
(~0.5 GiB), CUDA graphs (~0.5 GiB) and non-torch allocations such as LoRA buffers (~0.5 GiB)."""
TRAINER_OVERHEAD = 1 * GiB
"""The trainer's CUDA context, cuBLAS workspaces and the allocator's fragmentation."""
POLICY_SEQUENCES = 8
"""Sequences of ``max_model_len`` tokens the policy server's KV cache is sized for. Rollouts rarely
fill the context, so many more run at once in practice."""
JUDGE_SEQUENCES = 4
"""The same for a judge's server, which reads a group's trajectories in few long requests."""
FALLBACK_UTILIZATION = 0.5
"""``--gpu-memory-utilization`` for a CUDA server whose config names none and that no plan sized
(a server started on its own, or a model without a readable ``config.json``)."""


@dataclass(frozen=True)
class Card:
    """A GPU size to suggest, as ``nvidia-smi`` reports it."""

    name: str
    mib: int
    examples: str

    @property
    def total(self) -> int:
        return self.mib * MiB


CARDS = (
    Card("24 GB", 23034, "L4, A10G"),
    Card("40 GB", 40960, "A100 40GB"),
    Card("48 GB", 46068, "L40S, RTX A6000"),
    Card("80 GB", 81559, "H100, A100 80GB"),
    Card("141 GB", 143771, "H200"),
)
"""Common cards, smallest first."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan reads of a model's ``config.json`` (:meth:`from_config`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    experts: int = 1
    """Mixture-of-experts layers: every expert's MLP is counted."""
    name: str = "model"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "model") -> ModelShape:
        """From a Hugging Face ``config.json`` (a multimodal model's ``text_config`` when it has one)."""
        c = {**config, **config.get("text_config", {})} if "hidden_size" not in config else dict(config)
        try:
            hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            experts = int(c.get("num_experts") or c.get("num_local_experts") or 1)
            intermediate = int(c.get("moe_intermediate_size") or 0) if experts > 1 else 0
            return cls(
                hidden_size=hidden,
                intermediate_size=intermediate or int(c["intermediate_size"]),
                num_hidden_layers=int(c["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                vocab_size=int(c["vocab_size"]),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                experts=experts,
                name=name,
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            raise ConfigError(
                f"cannot size {name} for the GPU memory plan: its config.json has no usable {error}. "
                "Set gpu_memory_utilization on its VLLMConfig to size its server by hand"
            ) from None

    @property
    def parameters(self) -> int:
        """Parameter count: each layer's attention, MLP and two norms, the embeddings and the
        output layer (one matrix when tied), the final norm; biases (under 0.1%) are left out."""
        h, q, kv = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
        attention = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size * self.experts
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attention + mlp + 2 * h) + embeddings + h

    def lora_parameters(self, rank: int) -> int:
        """A LoRA of ``rank`` on q, k, v, o, gate, up and down (``LoRAConfig``'s default modules):
        rank x (inputs + outputs) for each."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
            self.intermediate_size * self.experts,
        )
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.num_hidden_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Keys and values of one token over every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def model_shape(model: str | Path) -> ModelShape | None:
    """The shape of the model in folder ``model`` (its ``config.json``); None when there is none.
    It is named after its folder (a hub snapshot's, ``models--Org--Name/snapshots/<commit>``, after
    the model)."""
    folder = Path(model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hub = folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")
    return ModelShape.from_config(
        config, name=folder.parent.parent.name.split("--")[-1] if hub else folder.name
    )


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server on the GPU (``name`` labels it in the table and in errors)."""

    name: str
    shape: ModelShape
    max_model_len: int
    sequences: int = POLICY_SEQUENCES
    utilization: float | None = None
    """An explicit ``gpu_memory_utilization``, which wins over the planned one."""
    sleeps: bool = False
    """Sleep mode: the server sleeps (level 1) while the trainer steps."""
    dtype_bytes: int = 2

    @property
    def weights(self) -> int:
        return self.shape.parameters * self.dtype_bytes

    @property
    def kv_tokens(self) -> int:
        return self.max_model_len * self.sequences

    @property
    def kv_cache(self) -> int:
        return self.kv_tokens * self.shape.kv_bytes_per_token(self.dtype_bytes)

    def overhead(self, total: int) -> int:
        """:data:`VLLM_OVERHEAD` and the activations of vLLM's profiling batch on a GPU of ``total``."""
        tokens, sequences = (8192, 1024) if total >= 70 * GiB else (2048, 256)
        s = self.shape
        layers = tokens * (s.hidden_size + 2 * s.intermediate_size) * self.dtype_bytes
        return VLLM_OVERHEAD + layers + sequences * s.vocab_size * 8

    def need(self, total: int) -> int:
        return self.weights + self.kv_cache + self.overhead(total)

    def minimum(self, total: int) -> int:
        """The least vLLM starts with: weights, overhead and one ``max_model_len`` sequence's KV."""
        return (
            self.weights
            + self.overhead(total)
            + self.max_model_len * self.shape.kv_bytes_per_token(self.dtype_bytes)
        )

    def utilization_on(self, total: int) -> float:
        """``--gpu-memory-utilization``: the explicit one, else the need rounded up to 0.01."""
        if self.utilization is not None:
            return self.utilization
        return math.ceil(self.need(total) / total * 100 - 1e-9) / 100

    def share(self, total: int) -> int:
        return math.ceil(self.utilization_on(total) * total)

    def asleep(self, total: int) -> int:
        """What it holds while the trainer steps: its overhead when it sleeps, else its share."""
        return self.overhead(total) if self.sleeps else self.share(total)


@dataclass(frozen=True)
class TrainerSpec:
    """The LoRA trainer on the same GPU (see the module's docstring for the estimate)."""

    shape: ModelShape
    tokens: int = 4096
    """Padded tokens per forward/backward pass (``TrainConfig.micro_batch_tokens``)."""
    gradient_checkpointing: bool = False
    lora_rank: int = 16
    """The largest rank a default ``VLLMConfig`` serves (``max_lora_rank``; ``LoRAConfig``'s is 8)."""
    logprob_chunk: int = 512
    """Positions whose vocabulary logits are computed at once (``TrainConfig.logprob_chunk``)."""

    @property
    def weights(self) -> int:
        return self.shape.parameters * 2

    @property
    def lora(self) -> int:
        return self.shape.lora_parameters(self.lora_rank) * 16

    @property
    def activations(self) -> int:
        s = self.shape
        layer = 2 * (12 * s.hidden_size + 4 * s.intermediate_size)  # bytes per token
        if self.gradient_checkpointing:
            kept = self.tokens * (s.num_hidden_layers * 2 * s.hidden_size + layer)
        else:
            kept = self.tokens * s.num_hidden_layers * layer
        return kept + self.logprob_chunk * s.vocab_size * 12

    @property
    def resident(self) -> int:
        """What it holds between steps."""
        return self.weights + self.lora + TRAINER_OVERHEAD

    @property
    def peak(self) -> int:
        return self.resident + self.activations


@dataclass(frozen=True)
class GpuMemoryPlan:
    """The parts of one GPU: vLLM servers and the trainer. ``str(plan)`` is a short table."""

    total: int
    servers: tuple[ServerSpec, ...]
    trainer: TrainerSpec | None = None

    def server(self, name: str) -> ServerSpec:
        return next(s for s in self.servers if s.name == name)

    def utilization(self, name: str) -> float:
        """The ``--gpu-memory-utilization`` of server ``name``."""
        return self.server(name).utilization_on(self.total)

    @property
    def serving(self) -> int:
        """What the servers take while they serve."""
        return sum(s.share(self.total) for s in self.servers)

    @property
    def headroom(self) -> int:
        """What the servers leave for the trainer while they serve."""
        return self.total - self.serving

    @property
    def sleep_mode(self) -> bool:
        return any(s.sleeps for s in self.servers)

    @property
    def need(self) -> int:
        """The most the GPU holds at once: servers and trainer at its peak; with sleep mode, the
        larger of serving (trainer between steps) and training (sleeping servers' overhead)."""
        trainer = self.trainer
        if trainer is None:
            return self.serving
        if not self.sleep_mode:
            return self.serving + trainer.peak
        training = sum(s.asleep(self.total) for s in self.servers) + trainer.peak
        return max(self.serving + trainer.resident, training)

    @property
    def starved(self) -> list[ServerSpec]:
        """Servers whose explicit share is too small for their weights, overhead and one sequence."""
        return [s for s in self.servers if s.share(self.total) < s.minimum(self.total)]

    @property
    def fits(self) -> bool:
        return self.need <= self.total and not self.starved

    def on(self, total: int) -> GpuMemoryPlan:
        """The same parts on a GPU of ``total`` bytes (explicit shares stay fractions)."""
        return dataclasses.replace(self, total=total)

    def with_gradient_checkpointing(self) -> GpuMemoryPlan:
        if self.trainer is None:
            return self
        return dataclasses.replace(
            self, trainer=dataclasses.replace(self.trainer, gradient_checkpointing=True)
        )

    def with_sleep(self, name: str) -> GpuMemoryPlan:
        """Server ``name`` sleeping while the trainer steps."""
        servers = tuple(dataclasses.replace(s, sleeps=True) if s.name == name else s for s in self.servers)
        return dataclasses.replace(self, servers=servers)

    def describe(self) -> str:
        """A short table: each part in GiB and as a share of the GPU."""
        t = self.total
        lines = [
            f"GPU memory plan: {_gib(t)} GiB GPU, sleep mode {'on' if self.sleep_mode else 'off'}"
            f" ({'fits' if self.fits else 'does not fit'})",
            f"  {'part':<34}{'GiB':>6}{'share':>7}  made of",
        ]
        for s in self.servers:
            made = (
                f"weights {_gib(s.weights)} + KV cache {_gib(s.kv_cache)} ({s.sequences} x {s.max_model_len}"
                f" tokens) + overhead {_gib(s.overhead(t))}"
            )
            if s.utilization is not None:
                made = f"set by gpu_memory_utilization; needs {_gib(s.need(t))}: {made}"
            if s.sleeps:
                made += f"; asleep while training: {_gib(s.asleep(t))}"
            lines.append(
                f"  {s.name + ' vLLM (' + s.shape.name + ')':<34}{_gib(s.share(t)):>6}{s.utilization_on(t):>7.2f}  {made}"
            )
        if (trainer := self.trainer) is not None:
            made = (
                f"weights {_gib(trainer.weights)} + LoRA state {_gib(trainer.lora)} + activations "
                f"{_gib(trainer.activations)} ({trainer.tokens} tokens"
                f"{', checkpointed' if trainer.gradient_checkpointing else ''}) + overhead {_gib(TRAINER_OVERHEAD)}"
            )
            lines.append(f"  {'trainer':<34}{_gib(trainer.peak):>6}{trainer.peak / t:>7.2f}  {made}")
        free = t - self.need
        lines.append(
            f"  {'at most in use' if self.sleep_mode else 'in use':<34}{_gib(self.need):>6}{self.need / t:>7.2f}"
        )
        lines.append(f"  {'free' if free >= 0 else 'missing':<34}{_gib(abs(free)):>6}{abs(free) / t:>7.2f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def check(self) -> GpuMemoryPlan:
        """This plan, or a :class:`ConfigError` that names each part's need, the GPU's size and
        what would make it fit: a larger card, gradient checkpointing, sleep mode, a smaller judge
        or ``max_model_len``."""
        if self.fits:
            return self
        t = self.total
        if starved := self.starved:
            s = starved[0]
            raise ConfigError(
                f"gpu_memory_utilization={s.utilization} gives the {s.name} vLLM server {_gib(s.share(t))} GiB "
                f"of this {_gib(t)} GiB GPU, less than its weights ({_gib(s.weights)} GiB), overhead "
                f"({_gib(s.overhead(t))} GiB) and one {s.max_model_len}-token sequence's KV cache need: "
                f"set at least {math.ceil(s.minimum(t) / t * 100) / 100:.2f}, or leave it unset to have it "
                "planned"
            )
        parts = [
            f"the {s.name} vLLM server ({s.shape.name}) needs {_gib(s.share(t))} GiB (weights "
            f"{_gib(s.weights)}, KV cache {_gib(s.kv_cache)}, overhead {_gib(s.overhead(t))})"
            for s in self.servers
        ]
        if (trainer := self.trainer) is not None:
            parts.append(
                f"the trainer {_gib(trainer.peak)} GiB (its own bf16 copy of the base weights "
                f"{_gib(trainer.weights)}, activations {_gib(trainer.activations)} for {trainer.tokens} tokens"
                f"{' with gradient checkpointing' if trainer.gradient_checkpointing else ''})"
            )
        raise ConfigError(
            f"the GPU memory plan does not fit: {', '.join(parts)}; {_gib(self.need)} GiB at once"
            f"{' (with sleep mode)' if self.sleep_mode else ''} on this {_gib(t)} GiB GPU. "
            f"{' '.join(self._fixes())} journeyman trains a LoRA on bf16 base weights (4-bit QLoRA "
            "training is not supported)."
        )

    def _fixes(self) -> list[str]:
        """What would make this plan fit: on this GPU, the cheapest change that does; on larger
        common cards, the cheapest change on each that needs less than the smaller one."""
        variants: list[tuple[str, GpuMemoryPlan]] = [("as planned", self)]
        if self.trainer is not None and not self.trainer.gradient_checkpointing:
            variants.append(
                ("with gradient_checkpointing=True in TrainConfig", self.with_gradient_checkpointing())
            )
        policy = next((s for s in self.servers if s.name == "policy" and not s.sleeps), None)
        if self.trainer is not None and policy is not None:
            for how, plan in list(variants):
                how = f"{how} and sleep_mode=True" if plan is not self else "with sleep_mode=True"
                variants.append((how, plan.with_sleep(policy.name)))
        fixes = []
        if here := next((how for how, plan in variants[1:] if plan.fits), None):
            fixes.append(f"It fits on this GPU {here}.")
        larger, cheapest = [], len(variants)
        for card in (c for c in CARDS if c.total > self.total):
            index = next((i for i, (_, plan) in enumerate(variants) if plan.on(card.total).fits), cheapest)
            if index < cheapest:
                article = "an" if card.name[0] == "8" else "a"
                larger.append(f"on {article} {card.name} card ({card.examples}) {variants[index][0]}")
                cheapest = index
        fixes.append(f"It fits {', or '.join(larger)}." if larger else "No common card holds it as planned.")
        smaller = ["a smaller base model"]
        if any(s.name != "policy" for s in self.servers):
            smaller.append("a smaller judge (or the policy's own server as judge)")
        smaller.append("a smaller max_model_len")
        if self.trainer is not None:
            smaller.append("a smaller micro_batch_tokens")
        fixes.append(f"Otherwise: {', '.join(smaller)}.")
        return fixes


def plan_gpu_memory(
    total: int,
    policy: ModelShape | None,
    judge: ModelShape | None = None,
    *,
    max_model_len: int = 4096,
    judge_max_model_len: int = 8192,
    policy_utilization: float | None = None,
    judge_utilization: float | None = None,
    sleep_mode: bool = False,
    train: bool = True,
    train_tokens: int = 4096,
    gradient_checkpointing: bool = False,
    lora_rank: int = 16,
) -> GpuMemoryPlan:
    """The plan for a policy server (with its trainer unless ``train`` is False) and an optional
    judge's server on a GPU of ``total`` bytes; :meth:`GpuMemoryPlan.check` raises when it does
    not fit. Utilizations given explicitly win over the planned ones."""
    servers = []
    if policy is not None:
        servers.append(
            ServerSpec("policy", policy, max_model_len, POLICY_SEQUENCES, policy_utilization, sleep_mode)
        )
    if judge is not None:
        servers.append(ServerSpec("judge", judge, judge_max_model_len, JUDGE_SEQUENCES, judge_utilization))
    trainer = (
        TrainerSpec(policy, train_tokens, gradient_checkpointing, lora_rank)
        if policy is not None and train
        else None
    )
    return GpuMemoryPlan(total, tuple(servers), trainer)


def visible_gpu_memory() -> list[int]:
    """The total memory, in bytes, of each GPU this process may use, in CUDA's order: read from
    ``nvidia-smi`` (torch is not imported), restricted to ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs;
    as in CUDA, the list ends at the first entry that names no GPU). Empty without ``nvidia-smi``."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    gpus: list[tuple[str, str, int]] = []
    for line in out.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and fields[2].isdigit():
            gpus.append((fields[0], fields[1], int(fields[2]) * MiB))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [total for _, _, total in gpus]
    chosen: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        match = next((g for g in gpus if entry and (entry == g[0] or g[1].startswith(entry))), None)
        if match is None:
            break
        chosen.append(match[2])
    return chosen


def _gib(size: int) -> str:
    return f"{size / GiB:.1f}"


REFERENCE_SHAPES: dict[str, ModelShape] = {
    "Qwen2.5-0.5B": ModelShape(896, 4864, 24, 14, 2, 64, 151936, True, name="Qwen2.5-0.5B"),
    "Qwen2.5-1.5B": ModelShape(1536, 8960, 28, 12, 2, 128, 151936, True, name="Qwen2.5-1.5B"),
    "Qwen2.5-7B": ModelShape(3584, 18944, 28, 28, 4, 128, 152064, False, name="Qwen2.5-7B"),
    "Qwen3-8B": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, False, name="Qwen3-8B"),
    "Llama-3.1-8B": ModelShape(4096, 14336, 32, 32, 8, 128, 128256, False, name="Llama-3.1-8B"),
}
"""The shapes of a few common base models (their ``config.json``), for :func:`fit_table`."""


def fit_table(
    policies: Sequence[str] = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen3-8B", "Llama-3.1-8B"),
    judge: str | None = "Qwen2.5-1.5B",
    cards: Sequence[Card] = CARDS[:4],
) -> str:
    """A Markdown table of what fits on each card with journeyman's defaults (a 4096-token
    ``max_model_len``, 4096-token micro-batches): the policy server's and judge's planned shares,
    or what it takes to fit."""
    header = f"| policy{' + ' + judge + ' judge' if judge else ''} | " + " | ".join(
        f"{c.name} ({c.examples})" for c in cards
    )
    rows = [header + " |", "|---" * (len(cards) + 1) + "|"]
    for name in policies:
        cells = []
        for card in cards:
            plan = plan_gpu_memory(
                card.total, REFERENCE_SHAPES[name], REFERENCE_SHAPES[judge] if judge else None
            )
            for how, variant in (
                ("", plan),
                ("gradient checkpointing", plan.with_gradient_checkpointing()),
                ("sleep mode", plan.with_sleep("policy")),
                ("checkpointing and sleep mode", plan.with_gradient_checkpointing().with_sleep("policy")),
            ):
                if variant.fits:
                    shares = "/".join(f"{s.utilization_on(card.total):.2f}" for s in variant.servers)
                    cells.append(f"{'with ' + how if how else 'fits'} ({shares})")
                    break
            else:
                least = plan.with_gradient_checkpointing().with_sleep("policy")
                cells.append(f"no (needs {_gib(least.need)} GiB)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    """Print :func:`fit_table` with and without a judge, and the 7B plan on an 80 GB card."""
    import sys

    out = sys.stdout
    out.write(fit_table() + "\n\n" + fit_table(judge=None) + "\n\n")
    shapes = REFERENCE_SHAPES
    out.write(str(plan_gpu_memory(CARDS[3].total, shapes["Qwen2.5-7B"], shapes["Qwen2.5-1.5B"])) + "\n")


if __name__ == "__main__":
    main()
