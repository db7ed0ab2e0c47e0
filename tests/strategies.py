"""Hypothesis strategies that build valid trajectories and groups."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import journeyman as jm

text = st.text(max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), finite, text)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)


@st.composite
def tool_calls(draw: st.DrawFn) -> dict[str, Any]:
    arguments = draw(st.one_of(text, st.dictionaries(names, st.one_of(st.integers(), text), max_size=3)))
    return {"id": draw(names), "type": "function", "function": {"name": draw(names), "arguments": arguments}}


@st.composite
def assistant_messages(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": draw(st.one_of(st.none(), text))}
    if draw(st.booleans()):
        message["tool_calls"] = draw(st.lists(tool_calls(), min_size=1, max_size=3))
    return message


@st.composite
def model_turns(draw: st.DrawFn) -> dict[str, Any]:
    turn: dict[str, Any] = {"type": "model_turn", "message": draw(assistant_messages())}
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, 49151), max_size=20))
        turn |= {
            "completion_id": draw(names),
            "model": draw(names),
            "prompt_token_ids": draw(st.lists(st.integers(0, 49151), max_size=20)),
            "completion_token_ids": ids,
            "logprobs": draw(
                st.lists(
                    st.one_of(st.none(), st.floats(max_value=0, allow_nan=False)),
                    min_size=len(ids),
                    max_size=len(ids),
                )
            ),
            "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"])),
            "sampling": {"temperature": draw(st.floats(0, 2))},
        }
    return turn


def items() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.builds(lambda c: {"role": "system", "content": c}, text),
        st.builds(lambda c: {"role": "user", "content": c}, text),
        st.builds(lambda c: {"role": "user", "content": [{"type": "text", "text": c}]}, text),
        assistant_messages(),
        st.builds(lambda i, c: {"role": "tool", "tool_call_id": i, "content": c}, names, text),
        model_turns(),
    )


tools = st.lists(
    st.builds(
        lambda n, d: {
            "type": "function",
            "function": {"name": n, "description": d, "parameters": {"type": "object"}},
        },
        names,
        text,
    ),
    max_size=3,
)


@st.composite
def trajectories(draw: st.DrawFn) -> jm.Trajectory:
    history = {
        "conversation": draw(st.lists(items(), max_size=6)),
        "tools": draw(st.one_of(st.none(), tools)),
    }
    return jm.Trajectory(
        **history,
        additional_histories=draw(
            st.lists(st.just(history) | st.builds(lambda n: {"name": n}, names), max_size=2)
        ),
        reward=draw(st.one_of(st.none(), finite)),
        metrics=draw(st.dictionaries(names, st.one_of(st.integers(), finite, st.booleans()), max_size=3)),
        metadata=draw(st.dictionaries(names, scalar, max_size=3)),
        logs=draw(st.lists(text, max_size=2)),
        timings=draw(st.dictionaries(names, st.floats(0, 1e6), max_size=2)),
        initial_policy_version=draw(st.one_of(st.none(), st.integers(0, 1000))),
    )


@st.composite
def groups(draw: st.DrawFn) -> jm.TrajectoryGroup:
    group = jm.TrajectoryGroup(
        draw(st.lists(trajectories(), max_size=3)),
        metadata=draw(st.dictionaries(names, scalar, max_size=2)),
    )
    for message in draw(st.lists(text, max_size=2)):
        group.record_failure(RuntimeError(message), stage="rollout")
    return group
