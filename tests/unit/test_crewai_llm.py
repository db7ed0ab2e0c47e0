"""``crew_llm``: a crew's ``crewai.LLM`` on the gateway's per-rollout URL, with the rollout's seed
inside the training loop. Its calls through the real gateway are in tests/integration/test_examples.py
(the CrewAI example)."""

from __future__ import annotations

import pytest

import journeyman as jm
from journeyman.integrations.crewai import crew_llm
from journeyman.loop import RolloutInfo, _current

MODEL = jm.Model(
    name="agent", project="test", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="secret"
)


def test_each_rollout_calls_the_gateway_on_a_url_of_its_own() -> None:
    first, second = crew_llm(MODEL, temperature=0.7), crew_llm(MODEL)
    assert first.model == "agent" and first.temperature == 0.7 and first.api_key == "secret"
    assert first.base_url.startswith("http://127.0.0.1:9/r/") and first.base_url.endswith("/v1")
    assert first.base_url != second.base_url
    assert crew_llm(MODEL, rollout_id="ticket-42").base_url == "http://127.0.0.1:9/r/ticket-42/v1"
    assert first.seed is None  # outside a training loop: the endpoint's sampling


def test_inside_a_loops_rollout_the_url_says_which_and_the_seed_is_the_rollouts() -> None:
    token = _current.set(RolloutInfo(split="val", step=2, index=0, sample=3, seed=99))
    try:
        llm = crew_llm(MODEL)
        assert llm.base_url.startswith("http://127.0.0.1:9/r/val-2-0-3-") and llm.seed == 99
        assert crew_llm(MODEL, seed=7).seed == 7  # a seed of the caller's stays
    finally:
        _current.reset(token)


def test_a_model_without_an_endpoint_says_to_register_it_first() -> None:
    with pytest.raises(jm.ConfigError, match=r"build the crew's LLM after `await model\.register"):
        crew_llm(jm.Model(name="unregistered", project="test"))
