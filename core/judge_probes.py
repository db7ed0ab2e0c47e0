"""Probes for a judge: attempts a policy can learn to make, which must score below the attempt they
were made from.

A judge that ranks the base policy's attempts well can still be fooled by what training finds next:
a policy trained on a small verdict judge's P(yes) can learn to write its answer as prose without
calling a tool (the email-search example's policy did), which such a judge scores highly.
Calibration on the groups alone cannot see it: they hold no such attempt.

:func:`made_up_answers` makes such attempts from a successful one: the same request and the same
final answer with the tool calls and results that led to it left out (:func:`without_the_work`),
and, when the answer was given through a tool call, the same answer written as text with no call at
all (:func:`as_text`), the form the email policy found. For a tool-using task each is a made-up
answer (right only by luck, or copied from somewhere else), and a judge that rewards the work, not
the claim, scores it lower. The opposite hack is the work without the answer
(:func:`without_the_answer`): an attempt that searched and read the right email and then ended with
an empty reply, which a small judge can score close to a real success. :func:`probes` gives all of
them; ``calibrate_judge(probes=True)`` judges them beside each group and counts how often the
success scores higher (the measurements behind these probes: see docs/results/).
"""

from __future__ import annotations

import json
from typing import Any

from journeyman.trajectory import Trajectory

__all__ = ["as_text", "made_up_answers", "probes", "without_the_answer", "without_the_work"]


def without_the_work(trajectory: Trajectory) -> Trajectory | None:
    """The attempt's last assistant message right after the user's last request, with every message
    between them (tool calls and their results, earlier replies) left out; the conversation before
    the request (system prompt, worked examples) stays. ``None`` when the attempt made no tool call
    after the request (nothing to leave out) or ended without an assistant message.

    A final message that is a tool call (``answer(...)``) stays a tool call: the copy then answers
    without having looked anything up. Additional histories are left out; the copy keeps the tools,
    the id (with ``"~probe"`` after it) and nothing else: no reward, no metrics.
    """
    messages = trajectory.openai_messages()
    request = max((n for n, m in enumerate(messages) if m["role"] == "user"), default=None)
    if request is None:
        return None
    after = messages[request + 1 :]
    last = next((n for n in range(len(after) - 1, -1, -1) if after[n]["role"] == "assistant"), None)
    if last is None or not any(_calls(m) for m in after[:last]):
        return None
    final: dict[str, Any] = after[last]
    return Trajectory(
        id=f"{trajectory.id}~probe",
        name=trajectory.name,
        conversation=[*messages[: request + 1], final],
        tools=trajectory.tools,
    )


def as_text(probe: Trajectory) -> Trajectory | None:
    """A probe whose final message is a tool call, with that call replaced by its string arguments
    written as the reply's text (``answer(text="TRK175467", email_id=17)`` becomes "TRK175467");
    ``None`` when the final message makes no call or the call has no string argument."""
    messages = probe.openai_messages()
    calls = messages[-1].get("tool_calls") if messages else None
    if not calls:
        return None
    values = [v for call in calls for v in _arguments(call).values() if isinstance(v, str) and v.strip()]
    if not values:
        return None
    return Trajectory(
        id=f"{probe.id}~text",
        name=probe.name,
        conversation=[*messages[:-1], {"role": "assistant", "content": " ".join(values)}],
        tools=probe.tools,
    )


def made_up_answers(trajectory: Trajectory) -> list[Trajectory]:
    """The made-up answers a success gives: :func:`without_the_work`, then its :func:`as_text` form
    when the answer was a tool call. Empty when the attempt made no tool call before its answer."""
    probe = without_the_work(trajectory)
    if probe is None:
        return []
    text = as_text(probe)
    return [probe] if text is None else [probe, text]


def without_the_answer(trajectory: Trajectory) -> Trajectory | None:
    """The attempt up to its last assistant message, which is replaced by an empty reply: every
    tool call and result kept, the answer (its text or its ``answer(...)`` call) gone. ``None`` when
    the attempt has no assistant message after the user's last request, or its last one is empty
    already. Histories, id and tools as in :func:`without_the_work` (``"~unanswered"`` after the id).
    """
    messages = trajectory.openai_messages()
    request = max((n for n, m in enumerate(messages) if m["role"] == "user"), default=None)
    if request is None:
        return None
    last = next(
        (n for n in range(len(messages) - 1, request, -1) if messages[n]["role"] == "assistant"), None
    )
    if last is None or not (
        messages[last].get("tool_calls") or str(messages[last].get("content") or "").strip()
    ):
        return None
    return Trajectory(
        id=f"{trajectory.id}~unanswered",
        name=trajectory.name,
        conversation=[*messages[:last], {"role": "assistant", "content": ""}],
        tools=trajectory.tools,
    )


def probes(trajectory: Trajectory) -> list[Trajectory]:
    """Every probe a success gives: its :func:`made_up_answers`, then :func:`without_the_answer`."""
    unanswered = without_the_answer(trajectory)
    return made_up_answers(trajectory) + ([] if unanswered is None else [unanswered])


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call.get("function", {}).get("arguments") or "{}")
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _calls(message: dict[str, Any]) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))
