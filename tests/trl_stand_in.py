"""Just enough of TRL's ``GRPOTrainer`` (and of accelerate's ``Accelerator`` under it) to run its
methods on their own, in one process: its loss (``tests/unit/test_loss_reference.py``) and its
training step's forward and loss (the GPU check, ``tests/gpu/checks.py``)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch


class OneProcess:
    """An ``Accelerator`` of one process: gathering and reducing change nothing."""

    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        yield


class GRPOStandIn:
    """The attributes ``GRPOTrainer._compute_loss`` and ``_get_per_token_logps_and_entropies``
    read, with everything around the loss switched off (no accumulation, no entropy terms, no
    vLLM correction)."""

    def __init__(
        self, loss_type: str, *, level: str = "token", epsilon: float, epsilon_high: float, beta: float,
        max_completion_length: int,
    ) -> None:  # fmt: skip
        self.loss_type, self.importance_sampling_level = loss_type, level
        self.epsilon_low, self.epsilon_high, self.beta = epsilon, epsilon_high, beta
        self.max_completion_length = max_completion_length
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
        self.model = SimpleNamespace(training=True)
        self.accelerator = OneProcess()
        self.current_gradient_accumulation_steps = 1
        self.top_entropy_quantile = 1.0
        self.off_policy_mask_threshold = None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self.model_accepts_loss_kwargs = False
        self._metrics: dict[str, Any] = defaultdict(lambda: defaultdict(list))
