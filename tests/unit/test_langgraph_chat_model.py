"""``chat_model``: the agent's ChatOpenAI on the gateway for one rollout, with the rollout's id on
each call (what canaries and the gateway's records key on). Its calls through the real gateway,
under a canary, are in tests/integration/test_langgraph_chat_model.py."""

from __future__ import annotations

import pytest

import journeyman as jm
from journeyman.integrations.langgraph import chat_model
from journeyman.loop import RolloutInfo, _current
from journeyman.records import ROLLOUT_HEADER

MODEL = jm.Model(
    name="agent", project="test", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="secret"
)


def header(llm: object) -> str:
    return str(llm.model_kwargs["extra_headers"][ROLLOUT_HEADER])  # type: ignore[attr-defined]


def test_it_calls_the_model_on_the_gateway_with_a_rollout_id_per_rollout() -> None:
    first, second = chat_model(MODEL, temperature=0.7), chat_model(MODEL, temperature=0.7)
    assert (first.model_name, first.openai_api_base, first.temperature) == (
        "agent",
        "http://127.0.0.1:9/v1",
        0.7,
    )
    assert first.openai_api_key.get_secret_value() == "secret"
    assert header(first) != header(second)
    assert first.root_async_client is second.root_async_client  # one HTTP client for every rollout
    assert chat_model(MODEL, temperature=0.2).root_async_client is not first.root_async_client
    assert header(chat_model(MODEL, rollout_id="ticket-42")) == "ticket-42"
    moved = MODEL.model_copy(update={"inference_base_url": "http://127.0.0.1:10/v1"})
    assert chat_model(moved).openai_api_base == "http://127.0.0.1:10/v1"  # a model registered again


def test_a_model_registered_again_gets_a_chat_model_on_its_new_endpoint() -> None:
    model = jm.Model(name="agent", project="test", inference_base_url="http://127.0.0.1:9/v1")
    assert chat_model(model).openai_api_base == "http://127.0.0.1:9/v1"
    model.inference_base_url = "http://127.0.0.1:11/v1"  # what register() does
    assert chat_model(model).openai_api_base == "http://127.0.0.1:11/v1"


def test_inside_a_loops_rollout_the_id_says_which_and_the_seed_is_the_rollouts() -> None:
    token = _current.set(RolloutInfo(split="train", step=3, index=1, sample=5, seed=1234))
    try:
        llm = chat_model(MODEL)
        assert header(llm).startswith("train-3-1-5-") and llm.seed == 1234
        assert chat_model(MODEL, seed=7).seed == 7  # a seed of the caller's stays
    finally:
        _current.reset(token)
    assert chat_model(MODEL).seed is None


def test_a_model_without_an_endpoint_says_to_register_it_first() -> None:
    with pytest.raises(jm.ConfigError, match=r"after `await model\.register"):
        chat_model(jm.Model(name="unregistered", project="test"))
