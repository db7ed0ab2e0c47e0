"""The demo's settings (``journeyman demo --help`` lists them as flags), checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from journeyman.config import LossType, Scale
from journeyman.errors import ConfigError
from journeyman.judge import Method, RewardFrom

__all__ = ["DEFAULT_JUDGE_MODEL", "DemoConfig"]

SERVING_DTYPES = ("auto", "bfloat16", "float16", "float32")

DEFAULT_JUDGE_MODEL = "qwen2.5-coder-1.5b"
"""The demo's local judge: of the embedded models, the one whose verdicts rank the demo's attempts
best and train the policy furthest (chosen by measurement; see docs/results/)."""


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 100
    """Training steps."""
    max_train_minutes: float | None = 30.0
    """Stop training once this much time went into it (then evaluate as usual)."""
    scenarios_per_step: int = 4
    group_size: int = 8
    train_scenarios: int = 256
    val_scenarios: int = 40
    val_samples: int = 4
    """Samples per held-out question at the training temperature (greedy is one more)."""
    temperature: float = 0.7
    max_tokens: int = 48
    learning_rate: float = 5e-4
    loss: LossType = "dapo"
    rank: int = 8
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass. None: on for models other than SmolLM2 and
    whenever a judge has a server of its own, where the training step's activations beside the
    vLLM servers can otherwise run the machine out of memory."""
    shaping: float = 0.0
    judge: Literal["none", "ruler"] = "none"
    """``ruler``: an LLM judge ranks each training group, and its score is the reward."""
    judge_model: str | None = None
    """The judge: with ``judge_base_url``, the model name that endpoint serves; else a local model
    (an embedded alias, a folder or a hub name) on a vLLM server of its own beside the policy's, or
    the policy's own base model, which the policy's server answers as well. None:
    :data:`DEFAULT_JUDGE_MODEL`, which calibration on the demo's groups favours."""
    judge_base_url: str | None = None
    """An OpenAI-compatible endpoint for the judge (key: $JOURNEYMAN_JUDGE_API_KEY or $OPENAI_API_KEY)."""
    judge_method: Method = "verdict"
    """``scores``: RULER, the whole group in one prompt; ``verdict``: each trajectory alone, scored
    by the judge's P(yes); ``pairwise``: every pair in both orders (``journeyman.judge``)."""
    judge_reference: bool = False
    """Before judging a group, the judge writes how its question should be done (which tool, which
    numbers), and checks each attempt against that (``judge_group(reference=True)``)."""
    judge_reward: RewardFrom = "best"
    """What the reward is made of: the judge's score, each attempt's rank in its group by score,
    or 1 for the group's best attempts and 0 for the rest (``judge_group(reward_from=...)``).
    ``best`` by default: the judge puts the right operation above the wrong one only just, so its
    scores and ranks let the policy collapse to calling ``multiply`` for every question
    (``journeyman.judge.RewardFrom``)."""
    judge_anyway: bool = False
    """Train with the judge even when, calibrated on the first step's groups against the
    programmatic check, it ranks no better than chance (the demo stops otherwise)."""
    reward_weight: float = 0.0
    """With a judge: reward = judge score + reward_weight x the programmatic reward (1 right, 0 wrong)."""
    scale_rewards: Scale | None = None
    """Divide advantages by the group's reward std, the batch's, or nothing (None: the trainer's
    default, ``group``). With a judge, group scaling keeps advantages closer to the programmatic
    check's (calibration's advantage alignment): a judge ranks within a group well, but its P(yes)
    is high for most attempts, so the size of a group's spread says little."""
    langfuse: bool = False
    """Export every trajectory (rollouts, evaluations) with its scores to Langfuse ($LANGFUSE_* keys)."""
    report_to: tuple[str, ...] | None = None
    """Experiment trackers that follow the run (``wandb``, ``tensorboard``, ``mlflow``); None: W&B
    when ``WANDB_API_KEY`` is set."""
    seed: int = 0
    sampling_seed: int | None = None
    """Seeds each rollout's sampling apart from ``seed`` (which keeps the questions and training):
    the same run, sampled otherwise. None: ``seed``."""
    merge_adapters: bool | None = None
    """Serve each step merged into vLLM's weights rather than as a LoRA adapter (faster on CPU).
    None: only for SmolLM2. A server without LoRA compiles its graphs at every start on CPU
    (vLLM 0.32's compile cache fails to load there), which takes minutes for the larger models, so
    other models are served as LoRA adapters (eager) unless this says otherwise."""
    serving_dtype: str = "auto"
    """vLLM's ``--dtype`` for the policy's server and a local judge's. ``auto``: bf16 where the
    machine has it. ``float32``: slower, but on CPU a seeded request samples the same tokens with
    the same logprobs alone or in any batch, and however its prompt is split (``VLLMConfig.dtype``),
    so a resumed or faulted run can repeat its clean twin's run step for step."""
    gpu_memory_utilization: float | None = None
    """CUDA: the share of the GPU the policy's vLLM server takes; None: planned from the models'
    sizes with the judge's server and the trainer (``backend/serving/gpu_memory.py``)."""
    sleep_mode: bool = False
    """CUDA: the policy's vLLM server sleeps while the trainer steps (``LocalBackend.sleep_mode``)."""
    train_device: str = "auto"
    """Where the trainer trains (``LocalBackend.train_device``): the GPU when torch sees one."""
    project: str = "demo"
    name: str | None = None
    """Model name (default: calc-<date>-<time>, a fresh run each time)."""
    root: Path | None = None
    base_model: str = "smollm2-135m"
    """An embedded alias (``journeyman model list``), a Hugging Face folder or a hub name."""
    worked_share: float | None = None
    """Share of each step's training groups with the four worked examples in the prompt; the others
    see the system prompt and tools only (zero-shot). None: 0 after a warm start; else 1 for SmolLM2,
    which calls no tool without them; 0.5 for other models: Qwen2.5 calls tools zero-shot but never
    answers after the result there, and can learn that from the groups with examples (the module's
    docstring)."""
    vllm_cores: str | None = None
    """CPU: the cores the policy's vLLM server is bound to (``"1"``, ``"0-3"``); None: every core."""
    trainer_threads: int | None = None
    """CPU: the trainer's torch threads; None: one per core."""
    tool_seconds: float = 0.0
    """Each tool call waits this long first, as real agents wait on APIs (for measuring overlap)."""
    max_steps_off_policy: int = 0
    """Sample up to this many later steps while a step trains (``TrainingLoop.max_steps_off_policy``)."""
    warm_start: str = "none"
    """``sft``: before RL, collect the training questions' successes with the worked examples
    (``warm_start_samples`` attempts each, success with the right tool call), teach them under the
    zero-shot prompt (``journeyman.sft.with_context``), then train zero-shot. ``none``: RL only."""
    warm_start_samples: int = 2
    """Attempts per training question when collecting the warm start's conversations."""
    warm_start_epochs: int = 2
    """Passes of the supervised run over the collected conversations."""
    warm_start_learning_rate: float = 2e-4
    """The supervised run's peak learning rate (cosine schedule)."""
    zero_shot_eval: bool = True
    """Also evaluate with no worked examples in the prompt, sampled and greedily (the prompt that
    is not trained on, when training uses worked examples)."""
    progress: bool = True
    viewer: bool = True
    """Serve the trajectory viewer (``journeyman ui``) on a free loopback port while the demo runs,
    and print its URL."""

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 0, "steps must be >= 0"),
            (self.max_train_minutes is None or self.max_train_minutes > 0, "max_train_minutes must be > 0"),
            (self.group_size >= 2, "group_size must be >= 2 (GRPO compares the rollouts of a group)"),
            (min(self.scenarios_per_step, self.val_scenarios, self.val_samples, self.max_tokens, self.rank) >= 1,
             "scenarios_per_step, val_scenarios, val_samples, max_tokens and rank must be >= 1"),
            (self.train_scenarios >= self.scenarios_per_step, "train_scenarios must be >= scenarios_per_step"),
            (self.temperature >= 0 and self.learning_rate > 0, "temperature must be >= 0 and learning_rate > 0"),
            (self.tool_seconds >= 0, f"tool_seconds must be >= 0, got {self.tool_seconds}"),
            (self.max_steps_off_policy >= 0, f"max_steps_off_policy must be >= 0, got {self.max_steps_off_policy}"),
            (self.loss in get_args(LossType), f"unknown loss {self.loss!r}: {', '.join(get_args(LossType))}"),
            (self.judge in ("none", "ruler"), f"unknown judge {self.judge!r}: none or ruler"),
            (self.reward_weight >= 0, "reward_weight must be >= 0"),
            (self.scale_rewards is None or self.scale_rewards in get_args(Scale),
             f"unknown scale_rewards {self.scale_rewards!r}: {', '.join(get_args(Scale))}"),
            (self.worked_share is None or 0 <= self.worked_share <= 1, "worked_share must be between 0 and 1"),
            (self.warm_start in ("none", "sft"), f"unknown warm_start {self.warm_start!r}: none or sft"),
            (self.warm_start_samples >= 1 and self.warm_start_epochs >= 1 and self.warm_start_learning_rate > 0,
             "warm_start_samples and warm_start_epochs must be >= 1 and warm_start_learning_rate > 0"),
            (self.judge == "ruler" or (self.judge_model is None and self.judge_base_url is None),
             "judge_model and judge_base_url need judge='ruler' (--judge ruler)"),
            (self.judge_reward in get_args(RewardFrom), f"unknown judge_reward {self.judge_reward!r}: score, rank or best"),
            (self.judge_method in get_args(Method), f"unknown judge_method {self.judge_method!r}: scores, verdict or pairwise"),
            (self.serving_dtype in SERVING_DTYPES,
             f"unknown serving_dtype {self.serving_dtype!r}: {', '.join(SERVING_DTYPES)}"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization must be above 0 and at most 1"),
            (self.judge_base_url is None or self.judge_model is not None,
             "judge_base_url needs judge_model (--judge-model): the model name that endpoint serves"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
