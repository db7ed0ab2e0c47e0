"""Rebuilding a trajectory from the observations and scores of one Langfuse trace.

Pure functions over the SDK's ``ObservationV2`` and ``ScoreV3`` objects (anything with the same
attributes), so they need no server. Two layouts are understood:

- traces journeyman exported: the ``journeyman`` metadata key holds what the Langfuse data model
  has no place for (token ids, logprobs, the exact metadata), so the trajectory comes back equal;
- traces other instrumentation recorded (Langfuse's LangChain ``CallbackHandler``, the OpenAI
  wrapper, ...): each generation's input is the conversation so far, its output the model's
  message. Generations whose inputs extend one another form one history; a generation whose input
  does not continue any earlier one starts another (a sub-agent, a trimmed context). Tool results
  that no later generation saw come from ``tool`` observations.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from journeyman.errors import InvalidDataError
from journeyman.trajectory import Trajectory, load_trajectory

__all__ = ["JUDGE_EXPLANATION", "KEY", "REWARD_SCORE", "SCHEMA", "trajectory_from_observations"]

logger = logging.getLogger("journeyman.integrations.langfuse")

REWARD_SCORE = "reward"
"""Name of the score that holds a trajectory's reward."""
JUDGE_EXPLANATION = "judge_explanation"
"""Trajectory metadata key whose text is exported as the reward score's comment."""
KEY = "journeyman"
"""Metadata key under which exported observations carry what a lossless import needs."""
SCHEMA = 1

_ROLES = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "tool": "tool",
}


def trajectory_from_observations(
    observations: Sequence[Any], scores: Sequence[Any] = (), reward_score: str = REWARD_SCORE
) -> Trajectory:
    """The trajectory recorded in one trace; the score named ``reward_score`` is its reward."""
    if not observations:
        raise InvalidDataError("a trace without observations holds no trajectory")
    by_id = {o.id: o for o in observations}
    roots = [o for o in observations if o.is_root_observation] or [
        o for o in observations if o.parent_observation_id not in by_id
    ]
    exports = [(root, info) for root in roots if (info := _export_info(root)) is not None]
    if exports:
        # Exported more than once (say, after re-judging): the latest export is the trajectory.
        root, info = max(exports, key=lambda export: export[0].start_time)
        data = _journeyman(_subtree(root, observations, by_id), by_id, info)
    else:
        root = min(roots or observations, key=lambda o: o.start_time)
        data = _foreign(observations, by_id, root)
    _apply_scores(data, scores, reward_score)
    try:
        return load_trajectory(data)
    except InvalidDataError as error:
        raise InvalidDataError(f"trace {root.trace_id} does not rebuild into a trajectory: {error}") from None


# Journeyman's own traces ---------------------------------------------------------------------


def _journeyman(observations: Sequence[Any], by_id: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    spans: dict[int, dict[str, Any]] = {}
    for o in observations:
        o_info = _info(o)
        if o_info is not None and isinstance(o_info.get("history"), int):
            spans[o_info["history"]] = o_info
    turns: dict[int, list[tuple[int, Any, dict[str, Any]]]] = {index: [] for index in spans}
    for o in observations:
        o_info = _info(o)
        if o.type == "GENERATION" and o_info is not None and isinstance(o_info.get("index"), int):
            turns.setdefault(_owner(o, by_id), []).append((o_info["index"], o, o_info))
    histories = [_history(spans[index], sorted(turns[index], key=lambda t: t[0])) for index in sorted(spans)]
    if not histories or sorted(spans)[0] != 0:
        raise InvalidDataError("a journeyman trace lost its root observation's metadata")
    main, *others = histories
    return {**info["trajectory"], **main, "additional_histories": others}


def _owner(observation: Any, by_id: dict[str, Any]) -> int:
    """The history index of the nearest ancestor that is a history span."""
    current = by_id.get(observation.parent_observation_id or "")
    while current is not None:
        info = _info(current)
        if info is not None and isinstance(info.get("history"), int):
            return int(info["history"])
        current = by_id.get(current.parent_observation_id or "")
    return 0


def _history(span: dict[str, Any], turns: list[tuple[int, Any, dict[str, Any]]]) -> dict[str, Any]:
    conversation: list[Any] = []
    if turns:
        _, last, _ = turns[-1]
        conversation = [*_as_list(_json(last.input)), _json(last.output)]
        for index, generation, info in turns:
            if index >= len(conversation):
                raise InvalidDataError(
                    f"generation {generation.id} claims conversation position {index}, but the last "
                    f"generation's input holds only {len(conversation) - 1} messages"
                )
            conversation[index] = {
                "type": "model_turn",
                "message": _json(generation.output),
                **info.get("turn", {}),
            }
    conversation.extend(span.get("tail") or [])
    return {"name": span.get("name"), "tools": span.get("tools"), "conversation": conversation}


# Traces recorded by other instrumentation ------------------------------------------------------


class _Thread:
    """One history being rebuilt: its messages and the positions of model turns."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.messages: list[dict[str, Any]] = []
        self.turns: dict[int, Any] = {}
        self.tools: dict[str, dict[str, Any]] = {}


def _foreign(observations: Sequence[Any], by_id: dict[str, Any], root: Any) -> dict[str, Any]:
    generations = [o for o in observations if o.type == "GENERATION"]
    generations.sort(key=lambda o: (o.start_time, len(_as_list(_json(o.input)))))
    threads: list[_Thread] = []
    skipped = 0
    for generation in generations:
        messages, tools = _messages(_as_list(_json(generation.input)))
        output = _message(_json(generation.output), default_role="assistant")
        if output is None or output["role"] != "assistant":
            skipped += 1
            continue
        thread = next((t for t in reversed(threads) if messages[: len(t.messages)] == t.messages), None)
        if thread is None:
            parent = by_id.get(generation.parent_observation_id or "")
            thread = _Thread(root.name if not threads else getattr(parent, "name", None))
            threads.append(thread)
        thread.turns[len(messages)] = generation
        thread.messages = [*messages, output]
        thread.tools.update((tool["function"]["name"], tool) for tool in tools)
    _add_tool_results(observations, threads)
    histories = [_thread_history(thread) for thread in threads] or [{"name": root.name, "conversation": []}]
    metadata: dict[str, Any] = {"langfuse_trace_id": root.trace_id}
    if root.session_id:
        metadata["langfuse_session_id"] = root.session_id
    main, *others = histories
    data: dict[str, Any] = {
        "id": root.trace_id,
        **main,
        "additional_histories": others,
        "metadata": metadata,
        "started_at": root.start_time,
        "finished_at": root.end_time,
    }
    if skipped:
        data["logs"] = [f"skipped {skipped} generation(s) without an assistant message as output"]
    return data


def _thread_history(thread: _Thread) -> dict[str, Any]:
    conversation: list[dict[str, Any]] = list(thread.messages)
    for position, generation in thread.turns.items():
        parameters = _json(generation.model_parameters)
        conversation[position] = {
            "type": "model_turn",
            "message": conversation[position],
            "model": generation.model,
            "sampling": parameters if isinstance(parameters, dict) and parameters else None,
        }
    return {"name": thread.name, "conversation": conversation, "tools": list(thread.tools.values()) or None}


def _add_tool_results(observations: Sequence[Any], threads: list[_Thread]) -> None:
    """Append the results of tool calls that no later generation saw (the agent's last step)."""
    for tool in sorted((o for o in observations if o.type == "TOOL"), key=lambda o: o.start_time):
        call_id = _metadata(tool).get("tool_call_id")
        if not isinstance(call_id, str):
            continue
        for thread in threads:
            called = any(call["id"] == call_id for m in thread.messages for call in m.get("tool_calls") or [])
            answered = any(m.get("tool_call_id") == call_id for m in thread.messages)
            if called and not answered:
                thread.messages.append(
                    {"role": "tool", "tool_call_id": call_id, "content": _tool_content(_json(tool.output))}
                )
                break


def _messages(raw: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Chat messages and tool definitions (the CallbackHandler appends those as ``tool`` entries)."""
    messages, tools = [], []
    for entry in raw:
        if (
            isinstance(entry, dict)
            and entry.get("role") == "tool"
            and "tool_call_id" not in entry
            and isinstance(entry.get("content"), dict)
            and isinstance(entry["content"].get("function"), dict)
        ):
            tools.append({"type": "function", "function": entry["content"]["function"]})
            continue
        message = _message(entry, default_role="user")
        if message is not None:
            messages.append(message)
    return messages, tools


def _message(raw: Any, default_role: str) -> dict[str, Any] | None:
    """An OpenAI-format message from the shapes instrumentations record (LangChain's included)."""
    if isinstance(raw, str):
        return {"role": default_role, "content": raw}
    if not isinstance(raw, dict):
        return None
    role = _ROLES.get(str(raw.get("role") or raw.get("type") or ""))
    if role is None:
        return None
    content = raw.get("content")
    message: dict[str, Any] = {"role": role}
    if role == "assistant":
        message["content"] = None if content is None else _content(content)
        calls = _tool_calls(raw)
        if calls:
            message["tool_calls"] = calls
        reasoning = (raw.get("additional_kwargs") or {}).get("reasoning_content")
        if isinstance(reasoning, str):
            message["reasoning_content"] = reasoning
    else:
        message["content"] = "" if content is None else _content(content)
    if role == "tool":
        message["tool_call_id"] = str(raw.get("tool_call_id") or "")
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    return message


def _content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [
            part if isinstance(part, dict) and "type" in part else {"type": "text", "text": str(part)}
            for part in content
        ]
    return json.dumps(content)


def _tool_calls(raw: dict[str, Any]) -> list[dict[str, Any]]:
    # LangChain records parsed `args`; the provider's raw call (exact argument text) may sit in
    # additional_kwargs, and is preferred when it is there.
    exact = {
        call["id"]: call["function"]
        for call in (raw.get("additional_kwargs") or {}).get("tool_calls") or []
        if isinstance(call, dict) and isinstance(call.get("function"), dict) and "id" in call
    }
    calls = []
    for call in [*(raw.get("tool_calls") or []), *(raw.get("invalid_tool_calls") or [])]:
        if not isinstance(call, dict):
            continue
        function = (
            call.get("function") if isinstance(call.get("function"), dict) else exact.get(call.get("id"))
        )
        if function is None:
            if not call.get("name"):
                continue
            args = call.get("args")
            function = {
                "name": call["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args or {}),
            }
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function.get("name"), "arguments": function.get("arguments") or ""},
            }
        )
    return calls


def _tool_content(output: Any) -> Any:
    if isinstance(output, dict) and "content" in output:
        return _content(output["content"])
    return _content("" if output is None else output)


# Scores and shared helpers -------------------------------------------------------------------


def _apply_scores(data: dict[str, Any], scores: Sequence[Any], reward_score: str) -> None:
    latest: dict[str, Any] = {}
    for score in sorted(scores, key=lambda s: s.timestamp):
        if score.data_type in ("NUMERIC", "BOOLEAN"):
            latest[score.name] = score
    metrics = data.setdefault("metrics", {})
    metadata = data.setdefault("metadata", {})
    for name, score in latest.items():
        if name == reward_score:
            data["reward"] = float(score.value)
            if score.comment and JUDGE_EXPLANATION not in metadata:
                metadata[JUDGE_EXPLANATION] = score.comment
        elif name not in metrics:
            metrics[name] = score.value


def _export_info(root: Any) -> dict[str, Any] | None:
    info = _info(root)
    if info is not None and info.get("schema") == SCHEMA and isinstance(info.get("trajectory"), dict):
        return info
    return None


def _subtree(root: Any, observations: Sequence[Any], by_id: dict[str, Any]) -> list[Any]:
    def under_root(observation: Any) -> bool:
        while observation is not None:
            if observation.id == root.id:
                return True
            observation = by_id.get(observation.parent_observation_id or "")
        return False

    return [o for o in observations if under_root(o)]


def _metadata(observation: Any) -> dict[str, Any]:
    """Metadata with JSON-encoded values decoded (Langfuse stores metadata values as strings)."""
    raw = observation.metadata or {}
    return {key: _json(value) for key, value in raw.items()} if isinstance(raw, dict) else {}


def _info(observation: Any) -> dict[str, Any] | None:
    info = _metadata(observation).get(KEY)
    if isinstance(info, str):  # exported as JSON text, then stored as a JSON string value
        info = _json(info)
    return info if isinstance(info, dict) else None


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, list):
        return value
    if isinstance(value, dict) and isinstance(value.get("messages"), list):
        return list(value["messages"])
    return [] if value is None else [value]
