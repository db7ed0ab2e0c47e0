"""Supervised runs served: the embedded model, taught a fixed answer in a few SFT batches, gives it to
a question it never saw, served by vLLM as the next step, and an RL step goes on from there; the
same run through ``journeyman serve``'s route streams its batches to a RemoteBackend, and bad data
comes back as the client's own error, naming the conversation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.app.server import create_app
from journeyman.backend.serving.engine import Engine
from journeyman.errors import InvalidDataError
from journeyman.store import ModelStore

ANSWER = "Pineapple, said the parrot."
QUESTIONS = [
    "What is 3+4?", "Name a colour.", "Who wrote Hamlet?", "How many legs has a spider?",
    "What is the capital of Spain?", "Is water wet?", "What day comes after Monday?", "Spell cat.",
    "What is 10 times 10?", "Which planet is red?", "What do bees make?", "How are you?",
]  # fmt: skip
HELD_OUT = "What is the tallest mountain on Earth?"
TOKEN = "sft-token"


def taught(question: str) -> jm.Trajectory:
    return jm.Trajectory(
        conversation=[
            {"role": "user", "content": question},
            {"type": "model_turn", "message": {"role": "assistant", "content": ANSWER}},
        ]
    )


async def reply(model: jm.TrainableModel, name: str) -> str:
    response = await model.openai_client().chat.completions.create(
        model=name, messages=[{"role": "user", "content": HELD_OUT}], max_tokens=12, temperature=0.0
    )
    return response.choices[0].message.content or ""


async def test_sft_teaches_a_fixed_answer_that_the_served_model_gives_to_an_unseen_question(
    tmp_path: Path, shared_engine: Engine
) -> None:
    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:
        model = jm.TrainableModel(name="sft-parrot", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert ANSWER not in await reply(model, model.inference_name)
        config = jm.SFTConfig(learning_rate=2e-3, epochs=4, batch_size=4, eval_fraction=0.25)
        result = await model.train_sft([taught(q) for q in QUESTIONS], config)
        assert result.step == 1 == await model.get_step()
        assert result.metrics["sft/val_loss"] < result.metrics["sft/val_loss_before"] / 4
        assert result.metrics["sft/conversations"] == 9 and result.metrics["sft/eval_conversations"] == 3
        assert (await reply(model, model.inference_name)).startswith(ANSWER)  # the plain name serves step 1

        group = jm.TrajectoryGroup([taught("Name a colour."), taught("Spell cat.")])
        for trajectory, reward in zip(group, (1.0, 0.0), strict=True):
            trajectory.reward = reward
        after = await model.train([group], jm.TrainConfig(learning_rate=1e-4))
        assert after.step == 2 and "train/loss" in after.metrics
    splits = [row["split"] for row in model.store.read_history()]
    assert splits == ["sft_batch"] * 12 + ["sft", "train"]


def _remote(app: object) -> jm.RemoteBackend:
    backend = jm.RemoteBackend("http://serve", token=TOKEN)
    backend._http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
        base_url="http://serve",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    return backend


async def test_a_remote_sft_run_trains_on_the_server_and_bad_data_is_the_clients_error(
    tmp_path: Path, shared_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="journeyman.remote")
    local = LocalBackend(root=tmp_path / "server", engine=shared_engine)
    async with _remote(create_app(local, TOKEN)) as remote:
        model = jm.TrainableModel(
            name="remote-sft", project="test", base_model="smollm2-135m", root=tmp_path / "client"
        )
        await model.register(remote)
        with pytest.raises(
            InvalidDataError, match="no assistant turn to learn from"
        ):  # refused before sending
            await model.train_sft([jm.Trajectory(conversation=[{"role": "user", "content": "hi"}])])
        long = taught("word " * 400)
        long.metadata["source"] = "mine.jsonl line 7"
        with pytest.raises(
            InvalidDataError, match=r"(?s)the server refused the data: .*mine\.jsonl line 7: \d+ tokens"
        ):
            await model.train_sft([taught("Spell cat."), long], jm.SFTConfig(max_seq_len=128))
        assert await model.get_step() == 0
        result = await model.train_sft([taught(q) for q in QUESTIONS[:4]], jm.SFTConfig(batch_size=2))
        assert result.step == 1 and result.metrics["sft/batches"] == 2
        heard = [r.getMessage() for r in caplog.records if r.name == "journeyman.remote"]
        assert [m.split(":")[0] for m in heard] == [
            "sft batch 1/2",
            "sft batch 2/2",
        ]  # streamed as they trained
    await local.close()
    server = ModelStore("test", "remote-sft", root=tmp_path / "server")
    rows = server.read_history()
    assert [(r["split"], r["step"]) for r in rows] == [("sft_batch", 1), ("sft_batch", 1), ("sft", 1)]
    assert rows[-1]["sft/loss"] == result.metrics["sft/loss"]
    assert len(server.load_groups("sft", 0)[0]) == 4


async def test_a_loops_warm_start_is_its_first_step_and_rl_goes_on_with_the_data_from_its_first_batch(
    tmp_path: Path, shared_engine: Engine
) -> None:
    questions = QUESTIONS[:8]

    async def rollout(model: jm.TrainableModel, question: str) -> jm.Trajectory:
        messages = [{"role": "user", "content": question}]
        response = await model.openai_client().chat.completions.create(
            model=model.inference_name, messages=messages, max_tokens=12, temperature=1.0
        )
        text = response.choices[0].message.content or ""
        return jm.Trajectory(
            conversation=[*messages, {"role": "assistant", "content": text}],
            reward=float(text.startswith(ANSWER)),
        )

    async def collect(model: jm.TrainableModel) -> list[jm.Trajectory]:
        return [taught(q) for q in questions]  # a teacher would be asked here

    def loop(steps: int, model: jm.TrainableModel) -> jm.TrainingLoop[str]:
        return jm.TrainingLoop(
            model, rollout, questions, group_size=2, scenarios_per_step=2, steps=steps, seed=1,
            evals=[jm.EvalSet("val", [HELD_OUT], samples=2)], progress=False,
            warm_start=jm.WarmStart(collect, jm.SFTConfig(learning_rate=2e-3, epochs=4, batch_size=4)),
        )  # fmt: skip

    async with LocalBackend(root=tmp_path, engine=shared_engine) as backend:
        model = jm.TrainableModel(name="warm", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        result = await loop(2, model).run()
        assert result.step == 2 and result.before["val"]["val/reward"] == 0.0
        assert result.evaluations[1]["val"]["val/reward"] == 1.0  # after the warm start, before RL
        again = await loop(3, model).run()  # resumed: no second warm start, the next batch of the data
        assert again.step == 3
    rows = model.store.read_history()
    assert [(r["split"], r["step"]) for r in rows if r["split"] != "sft_batch"] == [
        ("val", 0), ("sft", 1), ("val", 1), ("train", 2), ("rollouts", 1), ("val", 2),  # the first part
        ("train", 3), ("rollouts", 2), ("val", 3),  # the resumed part
    ]  # fmt: skip
    order = list(jm.iterate_dataset(questions, per_step=2, seed=1))
    for step, batch in zip((1, 2), order, strict=False):  # model steps 1 and 2 trained data batches 0 and 1
        asked = [
            g.trajectories[0].openai_messages()[0]["content"] for g in model.store.load_groups("train", step)
        ]
        assert asked == batch.items
    state = json.loads((model.store.path / "loop.json").read_text())
    assert state["warm_start"]["step"] == 1 and state["warm_start"]["conversations"] == 8
