"""Probes for a judge: attempts a policy can learn to make, which must score below the attempt they
were made from.

A judge that ranks the base policy's attempts well can still be fooled by what training finds next.
Measured on the email-search example (bench/results.md): the 1.5B verdict judge ordered 97% of the
base policy's pairs right, and a policy trained on its P(yes) learned to write answers as prose
without calling a tool, which it scored up to 0.80. Calibration on the groups alone could not see
it: they held no such attempt.

:func:`without_the_work` makes that attempt from a successful one: the same request and the same
final answer, with the tool calls and tool results that led to it removed. For a tool-using task
it is a made-up answer (right only by luck, or copied from somewhere else), and a judge that
rewards the work, not the claim, scores it lower. ``calibrate_judge(probes=True)`` judges one per
success of each group beside the group and counts how often the success scores higher.
"""

from __future__ import annotations

from typing import Any

from journeyman.trajectory import Trajectory

__all__ = ["without_the_work"]


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


def _calls(message: dict[str, Any]) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))
