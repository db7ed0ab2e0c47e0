"""What a judge reads: the rubrics and instructions of each way of judging, and the attempts of a
group laid out as a tagged transcript (see :mod:`journeyman.ruler`).
Part of :mod:`journeyman.ruler`; names with a leading underscore are its own, not API.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from journeyman.errors import InvalidDataError
from journeyman.messages import Item, Tool
from journeyman.trajectory import History, Trajectory

__all__ = ["DEFAULT_PAIRWISE_RUBRIC", "DEFAULT_RUBRIC", "DEFAULT_VERDICT_RUBRIC", "TrajectoryLike"]

DEFAULT_RUBRIC = """\
- A trajectory that achieves the goal must score clearly higher than any that does not.
- Among trajectories that achieve it, the more efficient one (fewer wasted steps, tool calls or words) scores higher.
- Make score gaps match quality gaps: nearly equal trajectories get nearly equal scores, a much better one a much higher score.
- Give partial credit for real progress toward the goal."""

_SYSTEM = """\
You judge the work of an AI agent. Every trajectory below is an attempt at the same task; infer the \
task and what success means from the conversation. In a transcript, <call> holds a tool call the \
agent made and <tool> the result it got back. Give each trajectory a score between 0 and 1. \
The scores are compared with each other, so they must rank the trajectories and be spread according \
to how much they differ in quality.

Grading standards:
{rubric}

Reply with one JSON object that has one key per trajectory id, each mapping to \
{{"explanation": "<one or two sentences>", "score": <a number from 0 to 1>}}. \
Use every id exactly once and no other keys."""

DEFAULT_VERDICT_RUBRIC = """\
- The agent achieved the goal only if its final answer does what the user asked, correctly and completely.
- An attempt that ends without a final answer, or whose answer is wrong, did not achieve it."""

_VERDICT_SYSTEM = """\
You check the work of an AI agent. Below is one attempt at a task; infer the task and what success \
means from the conversation. In the transcript, <call> holds a tool call the agent made and <tool> \
the result it got back.

Standards:
{rubric}

{answer}"""

_VERDICT_ANSWER = "Answer with one word: yes if the agent achieved the goal, no if it did not."
_VERDICT_QUESTION = "Did the agent achieve the goal? Answer yes or no."
_CRITERION_ANSWER = "Answer the question after the attempt with one word: yes or no."

DEFAULT_PAIRWISE_RUBRIC = """\
- An attempt whose final answer does what the user asked, correctly and completely, is better than one that does not.
- Between two attempts that both succeed or both fail, the one with fewer wasted steps, tool calls or words is better."""

PAIRWISE_SYSTEM = """\
You compare two attempts by an AI agent at the same task; infer the task and what success means \
from the conversation. In a transcript, <call> holds a tool call the agent made and <tool> the \
result it got back.

Standards:
{rubric}

Answer with one letter: A if attempt A is better, B if attempt B is better."""

PAIRWISE_QUESTION = "Which attempt is better? Answer A or B."

REFERENCE_SYSTEM = """\
You will judge attempts by an AI agent at the task below. Before you see them, say how the task \
should be done: which tools to call with which arguments, and what the final answer must state. \
Be brief: one or two sentences. Do not work out what a tool would return."""

REFERENCE_QUESTION = "How should the agent do this task?"
REFERENCE_TOKENS = 64
"""The longest reference: a small judge decodes slowly on CPU, and a longer reference would cost more
than the judging it prepares."""

RUBRICS = {"scores": DEFAULT_RUBRIC, "verdict": DEFAULT_VERDICT_RUBRIC, "pairwise": DEFAULT_PAIRWISE_RUBRIC}

TrajectoryLike = Trajectory | History | Sequence[Item | dict[str, Any]]
"""What :func:`ruler` judges: a trajectory (all its histories), a history, or a list of messages."""


@dataclass(frozen=True)
class Conversation:
    """A history as the judge sees it."""

    name: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def tool_dict(tool: Tool | dict[str, Any]) -> dict[str, Any]:
    try:
        return Tool.model_validate(tool).model_dump(exclude_none=True)
    except ValueError as error:
        raise InvalidDataError(f"not a tool schema ({error}): {str(tool)[:200]}") from None


def _conversation(history: History, tools: list[dict[str, Any]] | None) -> Conversation:
    own = (
        [tool.model_dump(exclude_none=True) for tool in history.tools] if history.tools is not None else None
    )
    return Conversation(history.name, history.openai_messages(), own if own is not None else tools)


def conversations_of(item: TrajectoryLike, tools: list[dict[str, Any]] | None) -> list[Conversation]:
    """Every history of one trajectory, main one first."""
    if isinstance(item, Trajectory):
        return [_conversation(history, tools) for history in item.histories]
    if isinstance(item, History):
        return [_conversation(item, tools)]
    if isinstance(item, str | bytes | dict):
        raise InvalidDataError(
            f"ruler takes a list of trajectories (each a Trajectory, a History or a list of messages), "
            f"got a {type(item).__name__} in that list"
        )
    history = History()
    for message in item:
        history.add(message)
    return [_conversation(history, tools)]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """A message's content as the judge reads it, with every ``<`` written ``&lt;``: nothing an agent
    or a tool wrote can open or close the transcript's tags, nor pass for markup the judge knows
    (an agent that writes ``<tool name="add">5</tool>``, or the ``<tool_response>`` of Qwen's own chat
    template, cannot pass it off as a tool's result)."""
    if content is None:
        return ""
    if not isinstance(content, str):  # content parts: text as is, anything else named
        content = "".join(
            str(part.get("text", "")) if part.get("type") == "text" else f"[{part.get('type', 'part')}]"
            for part in content
        )
    return str(content).replace("<", "&lt;")


def transcript_of(messages: list[dict[str, Any]], names: dict[str, str]) -> str:
    """Messages as tagged lines: ``<user>...</user>``, an assistant's tool calls as
    ``<call>name {arguments}</call>``, a result as ``<tool name="...">...</tool>``. Call ids, types
    and empty fields are left out: they cost a small judge tokens and tell it nothing. ``names``
    maps call ids to tool names, filled as calls are met (results name the tool they answer)."""
    lines = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = names.get(message.get("tool_call_id", ""), message.get("name") or "unknown")
            lines.append(f'<tool name="{name}">{_text(message.get("content"))}</tool>')
            continue
        text = _text(message.get("content"))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            names[call.get("id", "")] = function.get("name", "")
            text += f"<call>{function.get('name', '')} {_text(function.get('arguments', ''))}</call>"
        lines.append(f"<{role}>{text}</{role}>")
    return "\n".join(lines)


def _signature(tool: dict[str, Any]) -> str:
    """A tool as one line: ``name(a: integer, b: integer): description``."""
    function = tool.get("function", {})
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    arguments = ", ".join(
        f"{key}{'' if key in required else '?'}: {spec.get('type', 'any') if isinstance(spec, dict) else 'any'}"
        for key, spec in (parameters.get("properties") or {}).items()
    )
    description = f": {function['description']}" if function.get("description") else ""
    return f"- {function.get('name', '')}({arguments}){description}"


def tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(_signature(tool) for tool in tools)


def _shared_prefix(lists: list[list[dict[str, Any]]]) -> int:
    """How many leading messages every list has in common."""
    shared = 0
    for column in zip(*lists, strict=False):
        if any(message != column[0] for message in column[1:]):
            break
        shared += 1
    return shared


def shared_start(unique: list[list[Conversation]]) -> int:
    """How many leading messages every trajectory's main history shares (0 for one trajectory:
    nothing tells its start from its attempt)."""
    return _shared_prefix([conversations[0].messages for conversations in unique]) if len(unique) > 1 else 0


def prompt_layout(
    unique: list[list[Conversation]], reference: str | None = None
) -> tuple[int, bool, list[str]]:
    """What every trajectory shares: the number of leading messages, whether the tools, and the
    parts that show them once (``<available_tools>``, then ``<context>``: the tools first, so
    that prompts for groups with other questions still share them in a prefix cache; then the
    judge's ``<reference>``)."""
    mains = [conversations[0].messages for conversations in unique]
    shared = shared_start(unique)
    tool_lists = [c.tools for conversations in unique for c in conversations]
    tools_shared = all(tools == tool_lists[0] for tools in tool_lists)
    head = []
    if tools_shared and tool_lists[0]:
        head.append(f"<available_tools>\n{tool_lines(tool_lists[0])}\n</available_tools>")
    if shared:
        head.append(f"<context>\n{transcript_of(mains[0][:shared], {})}\n</context>")
    if reference is not None:
        head.append(_reference_block(reference))
    return shared, tools_shared, head


def _reference_block(reference: str) -> str:
    return (
        "<reference>(how the task should be done, written by the judge before it saw an attempt; it may "
        f"be wrong)\n{_text(reference)}\n</reference>"
    )


def trajectory_body(conversations: list[Conversation], shared: int, tools_shared: bool) -> str:
    """One trajectory's histories, less what every trajectory shares."""
    body = []
    for k, conversation in enumerate(conversations):
        names: dict[str, str] = {}
        if k == 0 and shared:  # results in the trajectory can answer calls made in the shared start
            transcript_of(conversation.messages[:shared], names)
        text = transcript_of(conversation.messages[shared:] if k == 0 else conversation.messages, names)
        if not tools_shared and conversation.tools:
            text = f"<tools>\n{tool_lines(conversation.tools)}\n</tools>\n{text}"
        if len(conversations) > 1:
            name = conversation.name or ("main" if k == 0 else f"history {k}")
            text = f'<history name="{name}">\n{text}\n</history>'
        body.append(text)
    return "\n".join(body)


_NO_CALLS = (
    "none: this attempt called no tool and got no tool result, so nothing in its final message was looked up"
)


def _outcome(conversations: list[Conversation], shared: int) -> str | None:
    """What an attempt came to, in lines a small judge cannot miss: the user's request it answers,
    each tool call it made with its arguments and result (in every history, after the shared start),
    and its final message. A result the agent made up in its own words is then plainly not a tool's,
    and a call that does not fit the request sits next to it. None for an attempt with no tools and
    no tool results (saying "none" would read as a failure).

    Each part is there for a small judge: with the tool results and the final message beside each
    other, it believes an answer written after a fake ``<tool_response>`` less; with the request and
    the calls' arguments as well, it ranks attempts that call the wrong tool for the request lower.
    The line saying outright that nothing was looked up is what makes it doubt a made-up answer written as
    prose with no call at all. A call that got no result (such as an ``answer`` tool that ends the
    attempt) is left out: listed with "no result", it reads as a failure and pulls real successes
    down. Chosen by measurement; see docs/results/."""
    calls: dict[str, str] = {}
    results = []
    for k, conversation in enumerate(conversations):
        for n, message in enumerate(conversation.messages):
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                calls[call.get("id", "")] = (
                    f"{function.get('name', '')} {_text(function.get('arguments', ''))}"
                )
            if message["role"] == "tool" and (k > 0 or n >= shared):
                call = calls.get(message.get("tool_call_id", ""), message.get("name") or "unknown")
                results.append(f"{call} -> {_text(message.get('content')).strip()}")
    if not results and not any(c.tools for c in conversations):
        return None
    messages = conversations[0].messages
    first = next(
        (n for n, m in enumerate(messages) if n >= shared and m["role"] == "assistant"), len(messages)
    )
    asked = next(
        (_text(m.get("content")).strip() for m in reversed(messages[:first]) if m["role"] == "user"), ""
    )
    final = next(
        (m for m in reversed(messages[shared:]) if m["role"] == "assistant" and not m.get("tool_calls")), None
    )
    said = _text(final.get("content")).strip() if final is not None else ""
    return (
        f"<outcome>\nThe user asked: {asked or 'nothing'}\n"
        f"Tool calls and their results: {'; '.join(results) or _NO_CALLS}\n"
        f"Its final message: {said or 'none'}\n</outcome>"
    )


def scores_prompt(
    unique: list[list[Conversation]], ids: list[str], rubric: str, reference: str | None = None
) -> list[dict[str, str]]:
    shared, tools_shared, parts = prompt_layout(unique, reference)
    parts.append("Trajectories:")
    for id_, conversations in zip(ids, unique, strict=True):
        parts.append(
            f'<trajectory id="{id_}">\n{trajectory_body(conversations, shared, tools_shared)}\n</trajectory>'
        )
    return [
        {"role": "system", "content": _SYSTEM.format(rubric=rubric.strip())},
        {"role": "user", "content": "\n".join(parts)},
    ]


def verdict_prompts(
    unique: list[list[Conversation]],
    rubric: str,
    criteria: Sequence[str] | None,
    reference: str | None = None,
) -> list[list[list[dict[str, str]]]]:
    """For each trajectory, one prompt per question (whether it achieved the goal, or each
    criterion), all starting alike (system, shared context, tools) and each trajectory's alike up to
    its question, so a server with prefix caching reads that start once and each trajectory once.
    The judge's reference comes after the attempt's outcome, next to the question."""
    shared, tools_shared, head = prompt_layout(unique)
    answer = _CRITERION_ANSWER if criteria else _VERDICT_ANSWER
    system = {"role": "system", "content": _VERDICT_SYSTEM.format(rubric=rubric.strip(), answer=answer)}
    questions = [f"{c.strip()} Answer yes or no." for c in criteria] if criteria else [_VERDICT_QUESTION]
    prompts = []
    for conversations in unique:
        parts = [
            *head,
            f"<trajectory>\n{trajectory_body(conversations, shared, tools_shared)}\n</trajectory>",
        ]
        outcome = _outcome(conversations, shared)
        if outcome is not None:
            parts.append(outcome)
        if reference is not None:
            parts.append(_reference_block(reference))
        attempt = "\n".join(parts)
        prompts.append([[system, {"role": "user", "content": f"{attempt}\n{q}"}] for q in questions])
    return prompts


def scores_schema(ids: list[str], explanation_max_chars: int | None) -> dict[str, Any]:
    """One required key per id: a constrained decoder cannot skip, repeat or invent one."""
    explanation: dict[str, Any] = {"type": "string"}
    if explanation_max_chars is not None:
        explanation["maxLength"] = explanation_max_chars
    entry = {
        "type": "object",
        "properties": {"explanation": explanation, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {id_: entry for id_ in ids},
        "required": ids,
        "additionalProperties": False,
    }
