"""Serving settings chosen from the model: tool-call parser and chat template.

Model families differ exactly where a serving stack breaks: the chat template (does it render
``tools``?), how the model writes a tool call (hermes ``<tool_call>`` tags, Llama's JSON, Mistral's
``[TOOL_CALLS]``), and the stop tokens. :func:`serving_defaults` reads a Hugging Face folder
(``config.json``, the tokenizer's chat template, ``generation_config.json``) and picks:

- the chat template: ours when the folder carries one (``tool_chat_template.jinja``, written by
  :mod:`~journeyman.backend.models` for a model whose own template ignores tools), else the model's
  own;
- the tool-call parser: ``journeyman`` (``vllm_plugin/journeyman_tool_parser.py``) for templates
  that speak hermes-style ``<tool_call>`` tags, which accepts the tagged form and the bare and
  fenced JSON that small models write instead; vLLM's own parser for the families it names;
- stop tokens come from ``generation_config.json`` (vLLM reads it), which the conversion writes
  with every end-of-turn token.

Every choice can be overridden in :class:`~journeyman.backend.serving.vllm.VLLMConfig`. A hub name (no
folder here) gets the hermes-compatible default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..models import TOOL_TEMPLATE

__all__ = ["TOOL_PARSER_PLUGIN", "ServingDefaults", "serving_defaults"]

TOOL_PARSER_PLUGIN = Path(__file__).parent / "vllm_plugin" / "journeyman_tool_parser.py"
"""Our tolerant tool-call parser, loaded by vLLM with ``--tool-parser-plugin``; registered as
``journeyman``."""

# What a template writes for a tool call -> the vLLM parser that reads it back.
_PARSERS_BY_MARK = (
    ("<tool_call>", "journeyman"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
)


@dataclass(frozen=True)
class ServingDefaults:
    """What vLLM needs to serve one model's tool calls."""

    tool_parser: str
    """vLLM ``--tool-call-parser`` name."""
    chat_template: Path | None
    """A template file for ``--chat-template``; None: the tokenizer's own."""
    model_type: str | None
    """``config.json``'s ``model_type`` (``llama``, ``qwen2``, ...), None without a folder."""


def _own_template(folder: Path) -> str:
    """The tokenizer's chat template: ``chat_template.jinja`` (transformers 5) or the config's."""
    if (file := folder / "chat_template.jinja").is_file():
        return file.read_text()
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    template = config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    return str(template)


def serving_defaults(model: str | Path) -> ServingDefaults:
    """The tool parser and chat template for ``model`` (a folder, or a hub name)."""
    folder = Path(str(model))
    if not (folder / "config.json").is_file():
        return ServingDefaults("journeyman", None, None)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError):
        model_type = None
    ours = folder / TOOL_TEMPLATE
    template = ours.read_text() if ours.is_file() else _own_template(folder)
    parser = next((name for mark, name in _PARSERS_BY_MARK if mark in template), "journeyman")
    return ServingDefaults(parser, ours if ours.is_file() else None, model_type)
