"""The ``journeyman`` tool parser's registration: a vLLM that lacks what the parser is built on is
said loudly (vLLM then refuses ``--tool-call-parser journeyman``); no vLLM at all is journeyman's own
tests importing the file, and stays quiet."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import pytest

from journeyman.backend.serving.families import TOOL_PARSER_PLUGIN


def _import_plugin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The plugin file imported afresh, as vLLM's ``--tool-parser-plugin`` imports it."""
    spec = importlib.util.spec_from_file_location("journeyman_tool_parser_fresh", TOOL_PARSER_PLUGIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_vllm_without_the_parser_s_modules_is_an_error_that_says_what_follows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    moved = types.ModuleType("vllm")  # a release that moved the protocol and tool parser modules
    moved.__path__ = []
    moved.__version__ = "0.99.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", moved)
    with caplog.at_level(logging.DEBUG, logger="journeyman.tool_parser"):
        plugin = _import_plugin(monkeypatch)
    assert not hasattr(plugin, "JourneymanToolParser") and plugin.parse_tool_calls("", set()).calls == []
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert "journeyman tool parser is NOT registered: vLLM 0.99.0 has no vllm.entrypoints" in message
    assert "refuse --tool-call-parser journeyman" in message and "journeyman setup" in message


def test_without_vllm_only_the_parsing_is_defined_and_nothing_is_reported_as_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as in journeyman's environment
    with caplog.at_level(logging.DEBUG, logger="journeyman.tool_parser"):
        plugin = _import_plugin(monkeypatch)
    assert not hasattr(plugin, "JourneymanToolParser")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "vLLM is not installed: only parse_tool_calls is defined, no parser is registered")
    ]
