from __future__ import annotations

import json
import math

import pytest
from pydantic import TypeAdapter, ValidationError

from journeyman.errors import InvalidDataError
from journeyman.messages import FunctionCall, Item, ModelTurn, content_text

items = TypeAdapter(list[Item])


def test_each_role_becomes_its_message_type() -> None:
    parsed = items.validate_python(
        [
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": "dev note"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "hello"},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"type": "model_turn", "message": {"role": "assistant", "content": "ok"}},
        ]
    )
    kinds = [type(item).__name__ for item in parsed]
    assert kinds == [
        "SystemPrompt",
        "SystemPrompt",
        "UserMessage",
        "AssistantMessage",
        "ToolResult",
        "ModelTurn",
    ]
    assert parsed[1].role == "developer"
    assert content_text(parsed[2].content) == "hi there"


@pytest.mark.parametrize(
    ("bad", "location", "reason"),
    [
        (
            {"role": "robot", "content": "x"},
            "0",
            "needs a 'role' of system, developer, user, assistant or tool",
        ),
        ({"content": "x"}, "0", "needs a 'role'"),
        ({"role": "user"}, "0.user.content", "Field required"),
        ({"role": "tool", "content": "x"}, "0.tool.tool_call_id", "Field required"),
        (
            {"role": "user", "content": "x", "colour": "red"},
            "0.user.colour",
            "Extra inputs are not permitted",
        ),
        ("just text", "0", "not a chat message"),
    ],
)
def test_bad_messages_name_the_field_and_why(bad: object, location: str, reason: str) -> None:
    with pytest.raises(ValidationError) as caught:
        items.validate_python([bad])
    errors = caught.value.errors()
    assert any(".".join(map(str, e["loc"])) == location and reason in e["msg"] for e in errors), errors


def test_tool_call_arguments_keep_the_models_text_and_accept_dicts() -> None:
    as_text = FunctionCall(name="add", arguments='{"a":1,  "b":2}')
    assert as_text.arguments == '{"a":1,  "b":2}'  # exactly what the model wrote
    as_dict = FunctionCall(name="add", arguments={"a": 1, "b": 2})
    assert json.loads(as_dict.arguments) == {"a": 1, "b": 2}
    assert as_dict.parsed_arguments() == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("arguments", "reason"), [('{"a": 1', "not valid JSON"), ("[1, 2]", "not an object")]
)
def test_malformed_arguments_are_kept_but_parsing_them_says_why(arguments: str, reason: str) -> None:
    call = FunctionCall(name="add", arguments=arguments)  # a model's mistake is data
    with pytest.raises(InvalidDataError, match=reason):
        call.parsed_arguments()


def test_model_turn_logprobs_must_match_tokens() -> None:
    message = {"role": "assistant", "content": "ab"}
    with pytest.raises(ValidationError, match="has 2 tokens but logprobs has 1"):
        ModelTurn(message=message, completion_token_ids=[1, 2], logprobs=[-0.5])
    with pytest.raises(ValidationError, match="without completion_token_ids"):
        ModelTurn(message=message, logprobs=[-0.5])


def test_non_finite_logprobs_are_stored_as_missing() -> None:
    turn = ModelTurn(
        message={"role": "assistant", "content": "abc"},
        completion_token_ids=[1, 2, 3],
        logprobs=[-0.5, math.nan, -math.inf],
    )
    assert turn.logprobs == [-0.5, None, None]
    assert ModelTurn.model_validate_json(turn.model_dump_json()) == turn


def test_token_exactness_needs_both_prompt_and_completion_ids() -> None:
    message = {"role": "assistant", "content": "a"}
    assert ModelTurn(message=message, prompt_token_ids=[1], completion_token_ids=[2]).is_token_exact
    assert not ModelTurn(message=message, completion_token_ids=[2]).is_token_exact
    assert not ModelTurn(message=message).is_token_exact
