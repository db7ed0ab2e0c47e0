from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import journeyman as jm


def test_openai_client_is_made_once_with_an_explicit_http_client() -> None:
    model = jm.Model(
        name="gpt", project="p", inference_base_url="http://127.0.0.1:9/v1", inference_api_key="k"
    )
    client = model.openai_client()
    assert model.openai_client() is client
    assert str(client.base_url) == "http://127.0.0.1:9/v1/" and client.api_key == "k"
    # Not the SDK's self-closing wrapper, whose late close from __del__ can lose live responses.
    assert type(client._client) is httpx.AsyncClient
    assert model.inference_name == "gpt"


def test_names_are_validated_and_unregistered_models_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(jm.ConfigError, match="invalid name"):
        jm.Model(name="../x", project="p")
    with pytest.raises(jm.ConfigError, match="has no inference_base_url"):
        jm.Model(name="m", project="p").openai_client()
    trainable = jm.TrainableModel(name="m", project="p", base_model="smollm2-135m", root=tmp_path)
    with pytest.raises(jm.ConfigError, match=r"await model.register\(backend\)"):
        trainable.backend  # noqa: B018


async def test_log_stores_groups_and_appends_averages(tmp_path: Path) -> None:
    model = jm.Model(name="m", project="p", root=tmp_path)
    group = jm.TrajectoryGroup(
        [jm.Trajectory(reward=1.0, metrics={"turns": 2}), jm.Trajectory(reward=0.0, metrics={"turns": 4})]
    )
    group.record_failure(RuntimeError("x"))
    row = await model.log([group], split="val")
    assert row["step"] == 0 and row["val/reward"] == 0.5 and row["val/turns"] == 3.0
    assert row["val/failures"] == 1 and row["val/failure_rate"] == pytest.approx(1 / 3)
    assert model.store.load_groups("val", 0) == [group]
