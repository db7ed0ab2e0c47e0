"""A vLLM tool-call parser, ``journeyman``: hermes ``<tool_call>`` tags, plus the bare and fenced
JSON that small models write instead.

Qwen2.5-Coder-0.5B/1.5B pick the right tool zero-shot but often write the call without the tags
their chat template asks for, as a bare object or in a Markdown fence::

    <tool_call>{"name": "multiply", "arguments": {"a": 47, "b": 86}}</tool_call>     tagged
    {"name": "multiply", "arguments": {"a": 47, "b": 86}}                           bare
    ```json\\n{"name": "multiply", "arguments": {"a": 47, "b": 86}}\\n```              fenced

vLLM's ``hermes`` parser returns no tool call for the last two. This one returns all three, and
says which form each call had in the id it gives it (``call_tagged_<hex>``, ``call_bare_<hex>``,
``call_fenced_<hex>``), so journeyman's gateway can record the form and a reward can prefer the
canonical one.

What counts as a call (non-streaming responses):

- Text holding ``<tool_call>`` is parsed exactly as vLLM's hermes parser does: every tagged
  region is a call (a tag left open runs to the end), the name is not checked against the
  request's tools, the content is the text before the first tag, and if any region is not
  ``{"name": <string>, "arguments": ...}`` JSON the whole text stays content.
- Otherwise a JSON object ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is accepted
  for ``"arguments"``, as several model families write it), or a list of them, is a call when
  every ``name`` is one of the request's tools. It is ``fenced`` when it fills a ```json (or
  plain ```) block, alone or as several whitespace-separated values; an unclosed fence runs to
  the end. It is ``bare`` anywhere else in the text, except inside a fence of another language.
  JSON that is not a call (another shape, a tool the request does not have, invalid JSON) is
  content, unchanged.
- As for tags, the content of a response with calls is the text before the first call (None if
  empty; vLLM also drops it when it is only whitespace); text after a call is dropped from the
  message (it stays in the sampled tokens).
- Arguments are passed on as the model wrote them, JSON-encoded: an object normally, but also
  a list or a string (journeyman's gateway returns such calls as text, as it does for hermes).

Streaming keeps hermes's behaviour (tagged calls only, with ``call_tagged_`` ids): bare and
fenced calls are recognised in non-streaming responses only, since finding them means holding
back every ``{`` until the object closes.

vLLM loads this file with ``--tool-parser-plugin <this file>`` (``journeyman.backend.vllm``
passes it when ``tool_parser="journeyman"``). It runs in the vLLM environment, where journeyman
is not installed, so it imports nothing of journeyman. :func:`parse_tool_calls` is pure and
needs no vLLM: journeyman's tests import this file without it.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMS", "ParsedToolCalls", "form_of_tool_call_id", "parse_tool_calls", "tool_call_id"]

logger = logging.getLogger("journeyman.tool_parser")

FORMS = ("tagged", "bare", "fenced")
"""How a model wrote a tool call: in ``<tool_call>`` tags, as bare JSON, in a ```json fence."""

_TAG = "<tool_call>"
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # hermes's own
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[ \t]*\n?(.*?)(?:```|\Z)", re.DOTALL)
_JSON_START = re.compile(r"[{\[]")
_ID = re.compile(r"call_(tagged|bare|fenced)_[0-9a-f]+")
_decoder = json.JSONDecoder()


def tool_call_id(form: str) -> str:
    """A fresh tool call id that names the form: ``call_bare_<32 hex digits>``."""
    assert form in FORMS, form
    return f"call_{form}_{uuid.uuid4().hex}"


def form_of_tool_call_id(call_id: str | None) -> str | None:
    """The form a :func:`tool_call_id` names; None for any other id."""
    match = _ID.fullmatch(call_id or "")
    return match.group(1) if match else None


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None
    """The message content: all of the text when there is no call, else the text before the first."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(name, arguments as a JSON string), in the order written."""
    forms: list[str] = field(default_factory=list)
    """The form of each call (one of :data:`FORMS`)."""


def parse_tool_calls(text: str, tool_names: Collection[str]) -> ParsedToolCalls:
    """Find the tool calls in a model's text; ``tool_names`` are the request's tools."""
    if _TAG in text:
        return _tagged(text)
    found: list[tuple[int, str, list[tuple[str, str]]]] = []  # (start, form, calls) per span
    position = 0
    for fence in _FENCE.finditer(text):
        found += _bare(text, position, fence.start(), tool_names)
        language, body = fence.group(1).lower(), fence.group(2)
        if language in ("", "json") and (calls := _calls_in_values(body, tool_names)):
            found.append((fence.start(), "fenced", calls))
        position = fence.end()
    found += _bare(text, position, len(text), tool_names)
    if not found:
        return ParsedToolCalls(text)
    return ParsedToolCalls(
        text[: found[0][0]] or None,
        [call for _, _, calls in found for call in calls],
        [form for _, form, calls in found for _ in calls],
    )


def _tagged(text: str) -> ParsedToolCalls:
    """Exactly vLLM's ``Hermes2ProToolParser.extract_tool_calls``."""
    calls = []
    try:
        for closed, open_ended in _TAGGED.findall(text):
            call = json.loads(closed if closed else open_ended)
            name = call["name"]
            if not isinstance(name, str):  # vLLM's FunctionCall(name=...) refuses it
                raise TypeError(f"the tool name is {type(name).__name__}, not a string")
            calls.append((name, json.dumps(call["arguments"], ensure_ascii=False)))
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        logger.warning("a <tool_call> that is not a valid call stays content: %r", error)
        return ParsedToolCalls(text)
    return ParsedToolCalls(text[: text.find(_TAG)] or None, calls, ["tagged"] * len(calls))


def _bare(
    text: str, start: int, end: int, tool_names: Collection[str]
) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """The calls written as bare JSON in ``text[start:end]``."""
    found = []
    segment, position = text[:end], start
    while (match := _JSON_START.search(segment, position)) is not None:
        try:
            value, after = _decoder.raw_decode(segment, match.start())
        except (ValueError, RecursionError):  # not JSON from here: a call may still start further on
            position = match.start() + 1
            continue
        if calls := _calls(value, tool_names):
            found.append((match.start(), "bare", calls))
        position = after  # JSON that is not a call is skipped whole, never searched inside
    return found


def _calls_in_values(body: str, tool_names: Collection[str]) -> list[tuple[str, str]]:
    """The calls in a fence's body when it holds nothing but calls (whitespace-separated JSON)."""
    calls: list[tuple[str, str]] = []
    position = 0
    while (position := _skip_space(body, position)) < len(body):
        try:
            value, position = _decoder.raw_decode(body, position)
        except (ValueError, RecursionError):
            return []
        if not (found := _calls(value, tool_names)):
            return []
        calls += found
    return calls


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _calls(value: Any, tool_names: Collection[str]) -> list[tuple[str, str]]:
    """``value`` as calls if it is one call object or a non-empty list of them, else []."""
    items = value if isinstance(value, list) else [value]
    calls = [call for item in items if (call := _call(item, tool_names)) is not None]
    return calls if items and len(calls) == len(items) else []


def _call(item: Any, tool_names: Collection[str]) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in tool_names:
        return None
    for key in ("arguments", "parameters"):
        if key in item:
            return item["name"], json.dumps(item[key], ensure_ascii=False)
    return None


def _tool_names(tools: Sequence[Any] | None) -> set[str]:
    """The names of a request's tools (chat completions' ``{"function": {"name"}}``, or the
    Responses API's ``{"name"}``)."""
    names = set()
    for tool in tools or []:
        function = getattr(tool, "function", None)
        name = getattr(function, "name", None) or getattr(tool, "name", None)
        if isinstance(name, str):
            names.add(name)
    return names


def _not_registered(error: ImportError) -> None:
    """Say why the ``journeyman`` parser is not registered: quietly where vLLM is not installed
    (journeyman's tests import this file for :func:`parse_tool_calls`), loudly where a vLLM lacks
    what the parser is built on (a release that moved it), since vLLM then refuses
    ``--tool-call-parser journeyman`` at startup with a less helpful message."""
    try:
        import vllm
    except ImportError:
        logger.debug("vLLM is not installed: only parse_tool_calls is defined, no parser is registered")
        return
    logger.error(
        "the journeyman tool parser is NOT registered: vLLM %s has no %s (%s), so vLLM will refuse "
        "--tool-call-parser journeyman. Install the vLLM version journeyman pins (`journeyman setup`, "
        "or backend/serving/requirements/vllm-*.txt), or serve with another parser (VLLMConfig.tool_parser='hermes')",
        getattr(vllm, "__version__", "(version unknown)"), error.name or "module", error,
    )  # fmt: skip


# The parser vLLM serves. Imported without vLLM (journeyman's tests), only the above is defined.
try:
    from vllm.entrypoints.generate.base.protocol import (
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
except ImportError as error:
    _not_registered(error)
else:

    @ToolParserManager.register_module("journeyman")
    class JourneymanToolParser(Hermes2ProToolParser):  # type: ignore[misc]  # vLLM is untyped here
        """Hermes's parser that also reads bare and fenced JSON calls (non-streaming), and names
        each call's form in its id."""

        def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
            names = _tool_names(request.tools or self.tools)
            try:
                parsed = parse_tool_calls(model_output, names)
            except Exception:  # never let a parsing bug fail the request: the text is still an answer
                logger.exception("could not look for tool calls; the text stays content")
                parsed = ParsedToolCalls(model_output)
            if not parsed.calls:
                return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
            calls = [
                ToolCall(
                    id=tool_call_id(form),
                    type="function",
                    function=FunctionCall(name=name, arguments=arguments),
                )
                for (name, arguments), form in zip(parsed.calls, parsed.forms, strict=True)
            ]
            return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=parsed.content)

        def extract_tool_calls_streaming(self, *args: Any, **kwargs: Any) -> Any:
            delta = super().extract_tool_calls_streaming(*args, **kwargs)
            for call in (delta.tool_calls if delta is not None else None) or []:
                if call.id:  # the first delta of each call carries its id
                    call.id = tool_call_id("tagged")
            return delta
