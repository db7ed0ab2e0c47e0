"""Redeploy latency: a new adapter folder on disk -> the first answer from that version.

Each round deploys a fresh peft adapter through the router and times until a 1-token completion
for the plain alias comes back served by the new version: as a LoRA adapter ``bench@<step>``
(vLLM's runtime LoRA loading), or with ``--merged`` merged into the weights and reloaded in place.
No restart either way. ``--model`` picks the embedded model. Target: <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from bench.common import machine, serving_stack, summary, table


def make_adapters(model_dir: object, out: object, count: int) -> list[object]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    )
    folders = []
    for step in range(1, count + 1):
        folder = out / f"{step:04d}"  # type: ignore[operator]
        peft_model.save_pretrained(folder)
        folders.append(folder)
    return folders


async def measure(rounds: int, model: str, merged: bool, eager: bool = False) -> str:
    extra = ("--enforce-eager",) if eager else ()
    with serving_stack(
        served_name="base", model=model, max_lora_rank=8, merge_adapters=merged, extra_args=extra
    ) as stack:
        adapters = make_adapters(stack.model_dir, stack.workdir, rounds)
        load, first_answer, total = [], [], []
        async with httpx.AsyncClient(base_url=stack.gateway.base_url, timeout=60) as client:
            for step, folder in enumerate(adapters, start=1):
                start = time.perf_counter()
                served = await stack.router.deploy("bench", folder, step)  # type: ignore[arg-type]
                loaded = time.perf_counter()
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "bench", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                )
                done = time.perf_counter()
                record = stack.gateway.gateway.records.get(response.json()["id"])
                assert record is not None and record.served_model == served
                assert record.policy_version == step and served == ("base" if merged else f"bench@{step}")
                load.append(loaded - start)
                first_answer.append(done - loaded)
                total.append(done - start)
    # The first LoRA request after the server starts pays a one-time warm-up: report it apart.
    rows = [
        ("first deploy after start: folder on disk -> first answer", f"{total[0] * 1000:.2f}", "", ""),
        (
            f"later deploys: {'merge + reload' if merged else 'load'} + switch alias (router.deploy)",
            *summary(load[1:]),
        ),
        ("later deploys: first 1-token answer from the new version", *summary(first_answer[1:])),
        ("later deploys: folder on disk -> first answer", *summary(total[1:])),
    ]
    return (
        f"### Redeploy latency, {model}, {'merged into the weights' if merged else 'as a LoRA adapter'}"
        f"{', eager server' if eager else ''} "
        f"({rounds} deploys of a rank-8 all-linear adapter; {machine()})\n\n"
        + table(["phase", "p50 ms", "p95 ms", "mean ms"], rows)
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model", default="smollm2-135m", help="embedded model alias")
    parser.add_argument("--merged", action="store_true", help="merge each adapter into the weights")
    parser.add_argument("--eager", action="store_true", help="no compiled graphs (a faster start)")
    args = parser.parse_args()
    print(asyncio.run(measure(args.rounds, args.model, args.merged, args.eager)))
