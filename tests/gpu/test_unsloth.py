"""The Unsloth training path: runs where CUDA and Unsloth exist, skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("unsloth")

import journeyman as jm
from journeyman.backend.training.trainer import Trainer
from journeyman.config import TrainConfig
from tests.integration.test_trainer import _groups, _snapshot


def test_unsloth_step_updates_lora_weights_only(tmp_path: Path) -> None:
    trainer = Trainer("smollm2-135m", jm.ModelStore("gpu", "agent", root=tmp_path), engine="unsloth")
    trainer.load()
    assert trainer.uses_unsloth
    before = _snapshot(trainer)
    trainer.train_step(_groups(trainer.tokenizer), TrainConfig(learning_rate=1e-3))
    after = _snapshot(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)
    assert (trainer.store.checkpoint_path(1) / "adapter" / "adapter_config.json").is_file()
