"""Adapters merged into the served weights (VLLMConfig(merge_adapters=True)) on the real vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from tests.waits import until

from .conftest import FAMILIES, make_adapter

# Long enough to fill whole prefix-cache blocks: a stale cache would answer from the old weights.
PROMPT = "Here is a list of rivers and the seas they flow into. " + " ".join(
    f"River {n} flows into sea {n % 7}." for n in range(60)
)


# Qwen2 (3-4 minutes here: an fp32 0.5B beside its server) runs in the slow tier.
@pytest.fixture(scope="module", params=[FAMILIES[0], pytest.param(FAMILIES[1], marks=pytest.mark.slow)])
def merged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Router, GatewayThread, Path]]:
    """A merging server per family, one at a time (Qwen2: biases kept, the untied output written)."""
    from journeyman.backend.models import prepare_model

    model_dir = prepare_model(request.param)
    folder = tmp_path_factory.mktemp("merged")
    # Eager: compiling takes 2-5 minutes at every start on 2 cores (vLLM 0.32's compile cache fails
    # to load on CPU). The demo's smoke test serves SmolLM2 merged with compiled graphs.
    config = VLLMConfig(
        model=model_dir, served_name="base", merge_adapters=True, extra_args=("--enforce-eager",)
    )
    server = VLLMServer(config, log_path=folder / "vllm.log")
    server.start(timeout=900)
    records = RecordLog(folder / "records.jsonl")
    router = Router(server)
    try:
        with GatewayThread(Gateway(router, records)) as gateway:
            yield router, gateway, model_dir
    finally:
        records.close()
        server.stop()


def _reference(model_dir: Path, adapter: Path, prompt: list[int], completion: list[int]) -> tuple[Any, Any]:
    """Transformers' fp32 logprobs of ``completion`` with the adapter (peft) and without it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter
    ).eval()
    ids, targets = torch.tensor([prompt + completion]), torch.tensor(completion)[:, None]

    def logprobs() -> Any:
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        return logits.log_softmax(-1).gather(-1, targets).squeeze(-1)

    with torch.no_grad():
        with_adapter = logprobs()
        with model.disable_adapter():
            return with_adapter, logprobs()


async def test_a_merged_adapter_answers_like_the_adapter(
    merged: tuple[Router, GatewayThread, Path], tmp_path: Path
) -> None:
    import torch

    router, gateway, model_dir = merged
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="-", max_retries=0)
    records = gateway.gateway.records
    request = {
        "model": "agent", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
        "temperature": 1.0, "seed": 3, "logprobs": True, "extra_body": {"min_tokens": 24},
    }  # fmt: skip
    await router.deploy("agent", None, 0)
    before = records.get((await client.chat.completions.create(**request)).id)  # fills the prefix cache
    assert before is not None and before.policy_version == 0

    # The same random adapter moves Qwen2's logprobs 20x more than SmolLM2's (1.89 vs 0.098 mean),
    # so far that transformers in fp32 and bf16 disagree by 0.18 on it: no bf16 server can match.
    scale = 1.0 if model_dir.name.startswith("SmolLM2") else 0.2
    adapter = make_adapter(model_dir, tmp_path / "adapter", rank=8, seed=5, scale=scale)
    assert await router.deploy("agent", adapter, 1) == "base"
    after = records.get((await client.chat.completions.create(**request)).id)
    assert after is not None and after.policy_version == 1 and after.served_model == "base"
    prompt, completion = after.prompt_token_ids or [], after.choices[0].completion_token_ids or []
    assert prompt == before.prompt_token_ids and len(prompt) > 400 and len(completion) == 24
    sampled = torch.tensor(after.choices[0].logprobs or [])
    with_adapter, base = _reference(model_dir, adapter, prompt, completion)
    difference, off = (with_adapter - sampled).abs().mean(), (base - sampled).abs().mean()
    print(
        f"\n{model_dir.name}: merged adapter logprobs, vLLM vs transformers + peft: mean |diff| {difference:.4f}, base {off:.4f}"
    )
    assert difference < 0.06, f"mean |diff| {difference:.4f}"
    assert off > 4 * difference  # the merged adapter answers, not stale base weights or cache
    with pytest.raises(openai.NotFoundError, match="is not served: this server merges agent"):
        await client.chat.completions.create(**{**request, "model": "base"})  # the base weights are gone
    assert [m.id for m in (await client.models.list()).data] == ["agent"]

    # Back to the base weights at step 0 (e.g. a reset): the base model answers again.
    await router.deploy("agent", None, 0)
    again = records.get((await client.chat.completions.create(**request)).id)
    assert (
        again is not None and again.choices[0].completion_token_ids == before.choices[0].completion_token_ids
    )


async def test_requests_during_a_merged_deploy_all_answer_with_one_version(
    merged: tuple[Router, GatewayThread, Path], tmp_path: Path
) -> None:
    router, gateway, model_dir = merged
    client = openai.AsyncOpenAI(base_url=gateway.base_url + "/v1", api_key="-", max_retries=0, timeout=300)
    await router.deploy("agent", None, 0)
    adapter = make_adapter(model_dir, tmp_path / "adapter", rank=8, seed=6, scale=1.0)

    async def ask(n: int) -> str:
        response = await client.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": f"Count to {n}."}], max_tokens=32
        )
        return response.id

    served = router.resolve("agent")[0]
    running = [asyncio.create_task(ask(n)) for n in range(6)]
    await until(lambda: router.in_flight(served) == 6, "the six requests to be admitted")
    deploy = asyncio.create_task(router.deploy("agent", adapter, 7))
    await until(lambda: router.reloading, "the deploy to hold new requests")  # merged; draining
    later = [asyncio.create_task(ask(n)) for n in range(6, 10)]  # held until the reload is done
    await deploy
    ids = await asyncio.gather(*running, *later)
    versions = [record.policy_version for record in map(gateway.gateway.records.get, ids) if record]
    assert len(versions) == 10
    assert versions[:6] == [0] * 6 and versions[6:] == [7] * 4
