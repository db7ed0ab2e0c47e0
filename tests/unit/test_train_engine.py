"""Which engine trains: Unsloth only where it imports and the trainer is on a GPU; a broken
install falls back to transformers under ``auto``, and is an error that shows why when asked for."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from journeyman.backend.training.loading import unsloth_chosen
from journeyman.errors import ConfigError
from tests.logs import reaching_caplog

CUDA = torch.device("cuda", 0)  # a device object only: nothing here runs on it


@pytest.fixture
def broken_unsloth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed ``unsloth`` whose import raises, as a version clash does."""
    package = tmp_path / "unsloth"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('Unsloth: Please install unsloth_zoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unsloth", raising=False)


def test_auto_falls_back_to_transformers_when_unsloth_fails_to_import(
    broken_unsloth: None, caplog: pytest.LogCaptureFixture
) -> None:
    with reaching_caplog("journeyman.backend.training.loading"), caplog.at_level(logging.WARNING):
        assert unsloth_chosen("auto", CUDA) is False
    assert "`import unsloth` fails (Unsloth: Please install unsloth_zoo)" in caplog.text
    with pytest.raises(ConfigError, match="engine='unsloth', but `import unsloth` fails: Unsloth: Please"):
        unsloth_chosen("unsloth", CUDA)


def test_unsloth_is_never_chosen_off_the_gpu_and_is_refused_there_when_asked_for(
    broken_unsloth: None,
) -> None:
    assert unsloth_chosen("auto", torch.device("cpu")) is False
    assert unsloth_chosen("transformers", CUDA) is False
    with pytest.raises(ConfigError, match="trains on a CUDA GPU; the train device is cpu"):
        unsloth_chosen("unsloth", torch.device("cpu"))


def test_without_unsloth_auto_trains_with_transformers_and_asking_for_it_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert unsloth_chosen("auto", CUDA) is False
    with pytest.raises(ConfigError, match="needs Unsloth installed"):
        unsloth_chosen("unsloth", CUDA)


def test_the_dtype_follows_the_device_that_trains_not_whether_cuda_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The audit's first finding: bf16 was chosen because CUDA had it while the CPU trained."""
    from journeyman.backend.training import device as devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert devices.training_dtype("auto", torch.device("cpu")) == torch.float32
    assert devices.training_dtype("auto", CUDA) == torch.bfloat16
    assert devices.training_dtype("fp32", CUDA) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert devices.training_dtype("auto", CUDA) == torch.float32  # a GPU that only emulates bf16 (pre-Ampere)
