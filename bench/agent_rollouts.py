"""Rollouts of the demo's own agent workload: vLLM through the gateway vs HF ``generate``.

32 calculator questions run at once through the demo's LangGraph ReAct agent (its system prompt,
the worked examples where the demo uses them, its tools, T=0.7, 48 tokens a call), so the calls
share a long prefix and are ragged: one to three model calls a question, each with another prompt
length and answer length. Tokens/s counts the answer tokens the gateway recorded; the wall time
includes LangGraph and the tools.

Then, with the server stopped, HF ``generate`` replays exactly those calls: the recorded prompt
token ids, sorted by length and batched 8 at a time (left-padded, both cores), each batch
generating as many tokens as its longest recorded answer, in bf16 where the CPU has bf16
instructions and float32 elsewhere (what vLLM serves in). Only the recorded answer tokens count,
so a batch's padding and overrun are HF's cost, as they would be in a real HF rollout loop. HF
does not run LangGraph or the tools, which favours it. Target: >= 5x HF generate.

``--hf-every K`` replays every K-th of those batches only (the same batches a full replay runs),
for models whose full replay takes too long here; HF's tokens/s is then that of the batches run.
Each model's row is printed as soon as it is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import machine, serving_stack, table
from journeyman.records import CompletionRecord

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b"]
QUESTIONS = 32
BATCH = 8


@dataclass
class Run:
    seconds: float
    calls: list[tuple[list[int], int]]
    """Each model call: its prompt token ids and how many tokens it answered."""
    successes: int

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.calls)


async def agent_run(base_url: str, records: Path, worked_examples: bool, seed: int) -> Run:
    """The 32 questions at once through the demo's agent; the calls read back from the records."""
    import httpx
    from langchain_openai import ChatOpenAI

    from journeyman.backend.app.calculator import build_agent, make_scenarios, rollout

    before = _read(records)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        llm = ChatOpenAI(
            model="base", base_url=base_url + "/v1", api_key="-", temperature=0.7, max_tokens=48,
            disable_streaming=True, max_retries=0, timeout=600, http_async_client=http,
        )  # fmt: skip
        agent = build_agent(llm, worked_examples=worked_examples)
        scenarios = make_scenarios(QUESTIONS, seed=seed)
        start = time.perf_counter()
        trajectories = await asyncio.gather(*(rollout(agent, s) for s in scenarios))
        seconds = time.perf_counter() - start
    calls = [
        (record.prompt_token_ids or [], len(choice.completion_token_ids or []))
        for record in _read(records)[len(before) :]
        for choice in record.choices
    ]
    return Run(seconds, calls, sum(t.metrics["success"] == 1.0 for t in trajectories))


def _read(records: Path) -> list[CompletionRecord]:
    with contextlib.suppress(FileNotFoundError):
        return [CompletionRecord.model_validate_json(line) for line in records.read_text().splitlines()]
    return []


def hf_replay(
    model_dir: Path, calls: list[tuple[list[int], int]], every: int = 1, threads: int = 2
) -> tuple[float, int, int]:
    """HF ``generate`` on the same calls (sorted by prompt length, batches of 8), every ``every``-th
    batch: its seconds, the calls it replayed and their recorded answer tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from journeyman.backend.training.trainer import bf16_supported

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dtype = torch.bfloat16 if bf16_supported() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ordered = sorted((c for c in calls if c[1] > 0), key=lambda c: len(c[0]))
    batches = [ordered[i : i + BATCH] for i in range(0, len(ordered), BATCH)][::every]
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(len(ids) for ids, _ in batch)
            new = max(n for _, n in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
            model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=True, temperature=0.7, pad_token_id=pad,
            )  # fmt: skip
    replayed = [call for batch in batches for call in batch]
    return time.perf_counter() - start, len(replayed), sum(n for _, n in replayed)


async def measure(models: list[str], repeats: int, hf_every: int) -> str:
    header = [
        "model", "prompt", "calls/question", "prompt tokens", "solved", "agent s", "tokens/s (vLLM)",
        "HF replay: calls, s", "tokens/s (HF)", "speed-up",
    ]  # fmt: skip
    title = (
        f"### The demo's agent workload: {QUESTIONS} concurrent questions x{repeats}, vs HF generate "
        f"replaying the same calls ({machine()})\n\n"
    )
    rows = []
    for model in models:
        smollm2 = model == "smollm2-135m"  # as the demo serves it: merged (no LoRA) for SmolLM2 only
        with serving_stack(served_name="base", model=model, merge_adapters=smollm2) as stack:
            records = stack.workdir / "records.jsonl"
            await agent_run(stack.gateway.base_url, records, smollm2, seed=99)  # warm-up
            runs = [await agent_run(stack.gateway.base_url, records, smollm2, seed=i) for i in range(repeats)]
            model_dir = stack.model_dir
        calls = [c for run in runs for c in run.calls]
        seconds = sum(run.seconds for run in runs)
        tokens = sum(run.tokens for run in runs)
        prompt = sorted(len(ids) for ids, _ in calls)
        hf, replayed, replayed_tokens = hf_replay(model_dir, calls, hf_every)
        ours, theirs = tokens / seconds, replayed_tokens / hf
        rows.append(
            (
                model,
                "worked examples" if smollm2 else "system prompt + tools",
                f"{len(calls) / (repeats * QUESTIONS):.2f}",
                f"{prompt[0]}-{prompt[-1]}",
                f"{sum(r.successes for r in runs)}/{repeats * QUESTIONS}",
                f"{seconds:.1f}",
                f"{ours:.0f}",
                f"{replayed} of {len(calls)}, {hf:.1f}",
                f"{theirs:.0f}",
                f"{ours / theirs:.1f}x",
            )
        )
        print(f"{model} measured:\n" + table(header, rows[-1:]), flush=True)
    return title + table(header, rows) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-every", type=int, default=1, help="replay every K-th batch of 8 calls in HF")
    args = parser.parse_args()
    print(asyncio.run(measure(args.model, args.repeats, args.hf_every)))
