from __future__ import annotations

import sys
from pathlib import Path

import pytest

import journeyman as jm
from journeyman.backend import models, settings
from journeyman.errors import ModelPreparationError


def test_home_follows_env_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNEYMAN_HOME", str(tmp_path / "jm"))
    assert settings.journeyman_home() == tmp_path / "jm"
    assert settings.models_home() == tmp_path / "jm" / "models"
    monkeypatch.delenv("JOURNEYMAN_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.journeyman_home() == tmp_path / "xdg" / "journeyman"


def test_vllm_python_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNEYMAN_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(jm.ConfigError, match=r"JOURNEYMAN_VLLM_PYTHON points at .* does not exist"):
        settings.vllm_python()
    monkeypatch.setenv("JOURNEYMAN_VLLM_PYTHON", sys.executable)
    assert settings.vllm_python() == Path(sys.executable)
    monkeypatch.delenv("JOURNEYMAN_VLLM_PYTHON")
    monkeypatch.setenv("JOURNEYMAN_HOME", str(tmp_path))
    default = tmp_path / "venvs" / "vllm" / "bin" / "python"
    monkeypatch.setattr(settings.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(jm.ConfigError, match="Run `journeyman setup`"):
        settings.vllm_python()
    default.parent.mkdir(parents=True)
    default.write_text("")
    assert settings.vllm_python() == default


def test_unknown_alias_lists_the_known_ones() -> None:
    with pytest.raises(
        ModelPreparationError,
        match=r"unknown embedded model 'gpt-9'; known: qwen2\.5-coder-0\.5b, qwen2\.5-coder-1\.5b, smollm2-135m",
    ):
        models.prepare_model("gpt-9")


def test_base_model_names_resolve(tmp_path: Path) -> None:
    assert (
        models.resolve_base_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    folder = tmp_path / "my-model"
    folder.mkdir()
    with pytest.raises(ModelPreparationError, match=r"no config\.json"):
        models.resolve_base_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert models.resolve_base_model(str(folder)) == folder
