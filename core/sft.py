"""Supervised warm starts: the conversations a model learns from by imitation, and their checks.

``model.train_sft(trajectories, jm.SFTConfig(...))`` trains the adapter on each trajectory's model
turns (cross-entropy, every other token context). Where the trajectories come from:

- a run's stored groups, the best of each: :func:`best_trajectories` over
  :func:`stored_groups`;
- a JSONL of chat conversations in OpenAI's fine-tuning format: :func:`read_chat_jsonl`
  (:func:`write_chat_jsonl` writes one);
- traces in Langfuse: ``journeyman.integrations.langfuse.import_trajectories``;
- a teacher's rollouts: the same rollout function and tracers, run against a ``jm.Model`` that
  names the teacher (a bigger local model or any OpenAI-compatible endpoint).

:func:`with_context` puts the turns under another prompt (the successes of a prompt with worked
examples, taught under the zero-shot prompt). :func:`check_conversations` says what is wrong with a
conversation before anything trains.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from journeyman.errors import InvalidDataError
from journeyman.messages import AssistantMessage, Message, ModelTurn, Tool, ToolResult, UserMessage
from journeyman.store import ModelStore
from journeyman.trajectory import Trajectory, TrajectoryGroup, format_validation_error

__all__ = [
    "as_text",
    "best_trajectories",
    "check_conversations",
    "raise_problems",
    "read_chat_jsonl",
    "source_of",
    "split_eval",
    "stored_groups",
    "with_context",
    "write_chat_jsonl",
]

MAX_LISTED = 10
"""Problems listed in one error; the rest are counted."""


def source_of(trajectory: Trajectory, index: int) -> str:
    """Where a conversation came from, for an error message: ``file.jsonl line 3``, else its index and id."""
    source = trajectory.metadata.get("source")
    return str(source) if source else f"conversation {index} (trajectory {trajectory.id})"


def raise_problems(problems: list[str], what: str) -> None:
    """Raise :class:`~journeyman.errors.InvalidDataError` listing ``problems`` (the first
    :data:`MAX_LISTED`, the rest counted) found in ``what``; nothing when there are none."""
    if not problems:
        return
    listed = "\n  ".join(problems[:MAX_LISTED])
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise InvalidDataError(f"{len(problems)} problem(s) in {what}; nothing was trained:\n  {listed}{more}")


def check_conversations(trajectories: Sequence[Trajectory], what: str = "the supervised data") -> None:
    """Raise :class:`~journeyman.errors.InvalidDataError` listing every conversation that cannot be
    learned from: not a trajectory, no model turn (assistant turn) to learn, a tool call to a tool
    the conversation does not declare, a tool result answering no call. The length against the
    model's context is checked where the tokenizer is (the trainer)."""
    if isinstance(trajectories, (Trajectory, TrajectoryGroup)):
        raise InvalidDataError(
            "train_sft takes a list of trajectories: wrap one in a list, or pass a group's "
            "`group.trajectories` (or journeyman.sft.best_trajectories(groups))"
        )
    problems = [] if trajectories else ["no conversations were given"]
    raise_problems(problems + _problems(trajectories), what)


def _problems(trajectories: Sequence[Trajectory]) -> list[str]:
    problems: list[str] = []
    for index, trajectory in enumerate(trajectories):
        if not isinstance(trajectory, Trajectory):
            problems.append(f"item {index} is a {type(trajectory).__name__}, not a journeyman Trajectory")
            continue
        where = source_of(trajectory, index)
        if not any(history.model_turns for history in trajectory.histories):
            problems.append(
                f"{where}: no assistant turn to learn from (only the model's own turns are trained; "
                "in a JSONL, an assistant message with weight 0 is context)"
            )
        for history in trajectory.histories:
            problems += [
                f"{where}: {problem}" for problem in _tool_problems(history.conversation, history.tools)
            ]
    return problems


def _tool_problems(conversation: Sequence[Any], tools: Sequence[Tool] | None) -> list[str]:
    declared = {tool.function.name for tool in tools or []}
    calls: set[str] = set()
    problems = []
    for item in conversation:
        message = item.message if isinstance(item, ModelTurn) else item
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls or []:
                calls.add(call.id)
                if call.function.name not in declared:
                    problems.append(
                        f"a tool call to {call.function.name!r}, which the conversation does not declare "
                        f"({'tools: ' + ', '.join(sorted(declared)) if declared else 'no tools'}): "
                        "add its schema to the conversation's tools"
                    )
        elif isinstance(message, ToolResult) and message.tool_call_id not in calls:
            problems.append(
                f"a tool result for call {message.tool_call_id!r}, which no earlier assistant turn made"
            )
    return problems


# OpenAI's fine-tuning format --------------------------------------------------------------------


def read_chat_jsonl(path: str | Path) -> list[Trajectory]:
    """Conversations from a JSONL in OpenAI's chat fine-tuning format, one per line:
    ``{"messages": [...], "tools": [...]}``. Each assistant message becomes a model turn that
    trains, unless it has ``"weight": 0`` (then it is context, like a worked example). Each
    trajectory's ``metadata["source"]`` is ``"<file> line <n>"``, which errors name. Every line is
    checked (:func:`check_conversations`) and all problems are reported at once."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise InvalidDataError(f"cannot read {path}: {error}") from error
    trajectories: list[Trajectory] = []
    problems: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            trajectories.append(_conversation(json.loads(line), where))
        except json.JSONDecodeError as error:
            problems.append(f"{where}: not JSON ({error.msg} at column {error.colno})")
        except InvalidDataError as error:
            problems.append(f"{where}: {error}")
    problems += _problems(trajectories)
    problems.sort(key=lambda problem: int(problem.split(" line ", 1)[1].split(":", 1)[0]))
    raise_problems(problems, str(path))
    if not trajectories:
        raise InvalidDataError(f"{path} holds no conversations: one JSON object per line, with 'messages'")
    return trajectories


def _conversation(data: Any, where: str) -> Trajectory:
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise InvalidDataError('a line is one JSON object with a "messages" list (and optionally "tools")')
    if "functions" in data:
        raise InvalidDataError('"functions" is the older format: give the same schemas as "tools"')
    try:
        tools = [Tool.model_validate(tool) for tool in data.get("tools") or []] or None
    except ValidationError as error:
        raise InvalidDataError(format_validation_error(error, "tool")) from None
    trajectory = Trajectory(tools=tools, metadata={"source": where})
    for position, message in enumerate(data["messages"], 1):
        if not isinstance(message, dict):
            raise InvalidDataError(f"message {position} is not a JSON object")
        message = dict(message)
        weight = message.pop("weight", 1)
        if weight not in (0, 1):
            raise InvalidDataError(f"message {position}: weight is 0 or 1, got {weight!r}")
        try:
            if message.get("role") == "assistant" and weight == 1:
                trajectory.conversation.append(ModelTurn(message=AssistantMessage.model_validate(message)))
            else:
                trajectory.add(message)
        except (ValidationError, InvalidDataError) as error:
            text = (
                format_validation_error(error, "message")
                if isinstance(error, ValidationError)
                else str(error)
            )
            raise InvalidDataError(f"message {position} ({message.get('role', 'no role')}): {text}") from None
    return trajectory


def write_chat_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """Write the trajectories' main conversations in OpenAI's fine-tuning format (what
    :func:`read_chat_jsonl` reads): model turns as assistant messages, other assistant messages
    with ``"weight": 0``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for trajectory in trajectories:
            messages = []
            for item in trajectory.conversation:
                if isinstance(item, ModelTurn):
                    messages.append(item.message.model_dump(exclude_none=True))
                else:
                    message = item.model_dump(exclude_none=True)
                    if isinstance(item, AssistantMessage):
                        message["weight"] = 0
                    messages.append(message)
            line: dict[str, Any] = {"messages": messages}
            if trajectory.tools:
                line["tools"] = [tool.model_dump(exclude_none=True) for tool in trajectory.tools]
            file.write(json.dumps(line) + "\n")
    return path


# From runs ------------------------------------------------------------------------------------


def stored_groups(
    store: ModelStore, split: str = "train", steps: Iterable[int] | None = None
) -> list[TrajectoryGroup]:
    """The groups a run stored for ``split`` (``train``, ``val``, ...), every step or ``steps``."""
    chosen = store.steps(split) if steps is None else list(steps)
    return [group for step in chosen for group in store.load_groups(split, step)]


def best_trajectories(
    groups: Iterable[TrajectoryGroup], *, per_group: int | None = 1, min_reward: float | None = None
) -> list[Trajectory]:
    """The best ``per_group`` trajectories of each group by reward (None: all of them), keeping
    only those with a reward of at least ``min_reward``; unscored trajectories never. Ties keep the
    group's order. Copies: the groups are not changed."""
    chosen = []
    for group in groups:
        scored = [t for t in group if t.reward is not None and (min_reward is None or t.reward >= min_reward)]
        scored.sort(key=lambda t: -float(t.reward or 0.0))
        chosen += [t.model_copy(deep=True) for t in (scored if per_group is None else scored[:per_group])]
    return chosen


def split_eval(
    trajectories: Sequence[Trajectory], fraction: float, seed: int = 0
) -> tuple[list[Trajectory], list[Trajectory]]:
    """(train, eval): ``fraction`` of the conversations drawn with ``seed`` for the validation loss,
    at least one when the fraction is above 0 and two or more are given."""
    items = list(trajectories)
    count = round(len(items) * fraction)
    if fraction > 0 and len(items) > 1:
        count = min(max(count, 1), len(items) - 1)
    if count <= 0:
        return items, []
    held = set(random.Random(seed).sample(range(len(items)), count))
    return [t for i, t in enumerate(items) if i not in held], [t for i, t in enumerate(items) if i in held]


# Another prompt --------------------------------------------------------------------------------


def with_context(
    trajectory: Trajectory,
    context: Sequence[Message | dict[str, Any]],
    *,
    tools: Sequence[Tool | dict[str, Any]] | None = None,
) -> Trajectory:
    """The trajectory's turns under another prompt: everything before the task (the last user
    message before its first model turn: a system prompt, worked examples) is replaced by
    ``context``; ``tools`` replaces the declared tools when given. Each model turn keeps the tokens
    the model sampled but not its prompt's tokens (the prompt changed): the trainer renders each
    prompt with the chat template and counts, as ``data/drifted_turns``, the turns whose sampled
    tokens are not what the template renders for their text. A copy; the trajectory is not changed."""
    conversation = trajectory.conversation
    first_turn = next((i for i, item in enumerate(conversation) if isinstance(item, ModelTurn)), None)
    if first_turn is None:
        raise InvalidDataError(f"trajectory {trajectory.id} has no model turn to keep under another prompt")
    task = next((i for i in range(first_turn - 1, -1, -1) if isinstance(conversation[i], UserMessage)), None)
    if task is None:
        raise InvalidDataError(
            f"trajectory {trajectory.id} has no user message before its first model turn: nothing marks "
            "where its task begins"
        )
    copy = trajectory.model_copy(deep=True)
    new = Trajectory(conversation=list(context)).conversation  # validated like any conversation
    if any(isinstance(item, ModelTurn) for item in new):
        raise InvalidDataError(
            "the new context holds a model turn: give plain messages (worked examples as assistant messages)"
        )
    kept = []
    for item in copy.conversation[task:]:
        if isinstance(item, ModelTurn):
            item = item.model_copy(update={"prompt_token_ids": None})
        kept.append(item)
    copy.conversation = [*new, *kept]
    if tools is not None:
        copy.tools = Trajectory(tools=list(tools)).tools
    copy.metadata = {**copy.metadata, "context": "rewritten"}
    return copy


def as_text(trajectory: Trajectory) -> Trajectory:
    """The trajectory with its model turns as text only: no prompt or completion token ids, no
    logprobs. For a teacher's rollouts when the student's tokenizer is another one: the trainer then
    renders each turn with the student's chat template. A copy."""
    copy = trajectory.model_copy(deep=True)
    for history in [copy, *copy.additional_histories]:
        history.conversation = [
            item.model_copy(update={"prompt_token_ids": None, "completion_token_ids": None, "logprobs": None})
            if isinstance(item, ModelTurn)
            else item
            for item in history.conversation
        ]
    return copy
