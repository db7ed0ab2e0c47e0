"""Rollout throughput: completions through the gateway vs Hugging Face ``generate`` batch 8.

The same 32 prompts, each answered with exactly 64 new tokens (``ignore_eos``), at 8 and 32
concurrent requests through the gateway, with the model in vLLM's engine process (the default on
CPU) and in a worker process of its own, and the seconds each server took to start; then, with
the server stopped, HF ``generate`` in batches of 8 with both cores. Target: >= 5x HF generate.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from bench.common import machine, serving_stack, table

TOKENS = 64
PROMPTS = [f"Write a short story about the number {n}." for n in range(100, 132)]


async def through_gateway(base_url: str, concurrency: int, repeats: int) -> float:
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        return await _through(client, concurrency, repeats)


async def _through(client: openai.AsyncOpenAI, concurrency: int, repeats: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    produced = 0

    async def one(prompt: str) -> None:
        nonlocal produced
        async with gate:
            response = await client.chat.completions.create(
                model="base",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=TOKENS,
                temperature=1.0,
                extra_body={"min_tokens": TOKENS, "ignore_eos": True},
            )
            assert response.usage is not None
            produced += response.usage.completion_tokens

    start = time.perf_counter()
    for _ in range(repeats):
        await asyncio.gather(*(one(p) for p in PROMPTS))
    return produced / (time.perf_counter() - start)


def hf_generate(model_dir: object, batch: int, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    produced, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            inputs = tokenizer(
                texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False
            )
            output = model.generate(
                **inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=True, temperature=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            produced += (output.shape[1] - inputs["input_ids"].shape[1]) * output.shape[0]
    return produced / (time.perf_counter() - start)


async def measure(cpu_cores: list[str], repeats: int) -> str:
    rows = []
    model_dir = None
    for cores in cpu_cores:
        reserved = 0 if cores != "auto" else None
        for single in (True, False):  # the model in vLLM's engine process, or in a worker of its own
            how = f"cores: {cores}, {'engine process' if single else 'worker process'}"
            start = time.perf_counter()
            with serving_stack(
                served_name="base", cpu_cores=cores, reserved_cpus=reserved, cpu_single_process=single
            ) as stack:
                ready = time.perf_counter() - start
                model_dir = stack.model_dir
                await through_gateway(stack.gateway.base_url, 8, 1)  # warm-up
                for concurrency in (8, 32):
                    rate = await through_gateway(stack.gateway.base_url, concurrency, repeats)
                    rows.append(
                        (f"gateway -> vLLM, {concurrency} concurrent ({how})", f"{rate:.0f}", f"{ready:.0f}")
                    )
    hf = hf_generate(model_dir, batch=8, threads=2)
    rows.append(("HF generate, batch 8, bf16, 2 threads", f"{hf:.0f}", ""))
    rows = [(name, rate, f"{float(rate) / hf:.2f}x", ready) for name, rate, ready in rows]
    return (
        f"### Rollout throughput ({len(PROMPTS)} prompts x {TOKENS} new tokens, x{repeats}; {machine()})\n\n"
        + table(["how", "tokens/s", "vs HF generate", "s to start"], rows)
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpu-cores", nargs="+", default=["auto", "0-1"], help="VLLMConfig.cpu_cores values")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(asyncio.run(measure(args.cpu_cores, args.repeats)))
