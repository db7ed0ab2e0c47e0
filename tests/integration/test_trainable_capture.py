"""@trainable on a plain OpenAI-SDK tool agent calling the real vLLM server through the gateway."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

import journeyman as jm
from journeyman.backend.serving.gateway import GatewayThread
from journeyman.model import Registration
from tests.integration.conftest import SERVED_BASE
from tests.integration.test_langgraph_capture import check_token_exact
from tests.integration.test_serving import TOOLS


def _example(question: str, name: str, a: int, b: int, result: int, call_id: str) -> list[dict[str, Any]]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})},
    }
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": str(result)},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


FEW_SHOT = [
    {"role": "system", "content": "You are a calculator. Always call a tool, then state the answer."},
    *_example("What is 12 times 7?", "multiply", 12, 7, 84, "call_ex1"),
    *_example("What is 35 plus 48?", "add", 35, 48, 83, "call_ex2"),
    *_example("What is 9 times 13?", "multiply", 9, 13, 117, "call_ex3"),
]


class _GatewayBackend:
    """Registers models with the test run's gateway (the part of a backend @trainable relies on)."""

    def __init__(self, gateway: GatewayThread) -> None:
        self.gateway = gateway

    async def register(self, model: jm.TrainableModel) -> Registration:
        return Registration(base_url=f"{self.gateway.base_url}/v1", api_key="-", step=0)


async def calculator(scenario: dict[str, Any], client: openai.AsyncOpenAI) -> float:
    """Ask with worked examples; run each tool call; ask again; reward the right number."""
    messages: list[Any] = [*FEW_SHOT, {"role": "user", "content": scenario["question"]}]
    for _ in range(3):
        response = await client.chat.completions.create(  # type: ignore[call-overload]
            messages=messages, tools=TOOLS, temperature=0.7, seed=scenario["seed"], max_tokens=48
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return float(str(scenario["answer"]) in (message.content or ""))
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = (
                    arguments["a"] + arguments["b"]
                    if call.function.name == "add"
                    else arguments["a"] * arguments["b"]
                )
            except (ValueError, KeyError, TypeError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return 0.0


async def test_trainable_group_is_token_exact(gateway: GatewayThread, tokenizer: Any, tmp_path: Path) -> None:
    model = jm.TrainableModel(name=SERVED_BASE, project="test", base_model="smollm2-135m", root=tmp_path)
    await model.register(_GatewayBackend(gateway))  # type: ignore[arg-type]
    agent = jm.trainable(model)(calculator)
    groups = await jm.gather_trajectory_groups(
        (
            agent.group(
                {"id": f"q{seed}", "question": "What is 23 plus 19?", "answer": 42, "seed": seed}, n=1
            )
            for seed in range(8)
        ),
        progress=False,
    )
    trajectories = [t for g in groups for t in g]
    assert len(trajectories) == 8 and not any(g.failures for g in groups)
    with_tools = [t for t in trajectories if any(m.role == "tool" for m in t.messages[len(FEW_SHOT) :])]
    assert with_tools, "no sample called a tool"
    for trajectory in trajectories:
        assert trajectory.reward in (0.0, 1.0) and not trajectory.additional_histories
        assert trajectory.messages[len(FEW_SHOT)].content == "What is 23 plus 19?"
        check_token_exact(trajectory, gateway, tokenizer)
        records = gateway.gateway.records.for_rollout(str(trajectory.metadata["rollout_id"]))
        assert [r.completion_id for r in records] == [t.completion_id for t in trajectory.model_turns]
