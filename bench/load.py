"""Load: 64 concurrent rollouts through the gateway against the real vLLM server.

Two rounds of 64 concurrent two-call rollouts: plain ``AsyncOpenAI`` (two chat turns, the
second continuing the first) and a LangGraph ReAct agent (``create_agent``, ``ChatOpenAI``,
``TrajectoryTracer``). Each rollout has its own rollout id and a nonce in its prompt. After each
round every completion a client received must have exactly one record, filed under its own
rollout, holding its own nonce and the text the client got; the script fails otherwise. Reports
p50/p95 of rollout and per-call latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from bench.common import Stack, machine, percentile, serving_stack, table
from journeyman.backend.serving.gateway import ROLLOUT_HEADER


@dataclass
class Rollout:
    rollout_id: str
    nonce: str
    seconds: float = 0.0
    completions: dict[str, str] = field(default_factory=dict)
    """Completion id -> the text the client received."""


async def plain_rollout(client: openai.AsyncOpenAI, rollout: Rollout, tokens: int) -> None:
    headers = {ROLLOUT_HEADER: rollout.rollout_id}
    messages: list[Any] = [{"role": "user", "content": f"Remember the code {rollout.nonce}. Say it once."}]
    start = time.perf_counter()
    for _ in range(2):
        response = await client.chat.completions.create(
            model="base", messages=messages, max_tokens=tokens, temperature=1.0, extra_headers=headers
        )
        text = response.choices[0].message.content or ""
        rollout.completions[response.id] = text
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Once more."}]
    rollout.seconds = time.perf_counter() - start


def make_agent(base_url: str, tokens: int) -> Any:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        model="base", base_url=base_url, api_key="-", max_retries=0, max_tokens=tokens, temperature=1.0
    )
    return create_agent(llm, [add])


async def graph_rollout(agent: Any, rollout: Rollout, records: Any) -> None:
    from journeyman.integrations.langgraph import TrajectoryTracer

    tracer = TrajectoryTracer(records, raise_error=True)
    question = {"messages": [("user", f"Code {rollout.nonce}: what is 2 plus 3? Use the add tool.")]}
    start = time.perf_counter()
    result = await agent.ainvoke(question, config={"callbacks": [tracer]})
    rollout.seconds = time.perf_counter() - start
    for message in result["messages"]:
        if message.type == "ai":  # what LangChain received, by completion id
            rollout.completions[message.response_metadata["id"]] = message.content or ""
    turns = tracer.trajectory.model_turns
    if {t.completion_id for t in turns} != set(rollout.completions) or not all(
        t.is_token_exact for t in turns
    ):
        raise SystemExit(f"{rollout.rollout_id}: the traced trajectory is not the run's token-exact calls")


def check(stack: Stack, rollouts: list[Rollout]) -> list[float]:
    """Every received completion recorded once, under its rollout, with its nonce and text;
    returns the seconds each call spent in the gateway."""
    records = stack.gateway.gateway.records
    calls = []
    for rollout in rollouts:
        mine = records.for_rollout(rollout.rollout_id)
        by_id = {r.completion_id: r for r in mine}
        if len(by_id) != len(mine) or set(by_id) != set(rollout.completions):
            raise SystemExit(
                f"rollout {rollout.rollout_id}: records {sorted(by_id)} != received {sorted(rollout.completions)}"
            )
        for completion_id, text in rollout.completions.items():
            record = by_id[completion_id]
            if rollout.nonce not in json.dumps(record.messages):
                raise SystemExit(
                    f"{completion_id} is filed under {rollout.rollout_id} but holds another prompt"
                )
            if (record.choices[0].message.content or "") != text:  # type: ignore[union-attr]
                raise SystemExit(f"{completion_id}: recorded text differs from what the client got")
            calls.append((record.finished_at - record.started_at).total_seconds())
    return calls


def latency_row(kind: str, rollouts: list[Rollout], wall: float, calls: list[float]) -> list[object]:
    seconds = [r.seconds for r in rollouts]
    return [
        kind, len(rollouts), len(calls), "0",
        f"{percentile(seconds, 50):.1f}", f"{percentile(seconds, 95):.1f}",
        f"{percentile(calls, 50):.1f}", f"{percentile(calls, 95):.1f}", f"{wall:.1f}",
    ]  # fmt: skip


async def measure(concurrency: int, tokens: int) -> str:
    rows = []
    with serving_stack(served_name="base") as stack:
        base_url = f"{stack.gateway.base_url}/v1"
        records_before = 0
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="-", max_retries=0, timeout=600,
            http_client=httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)),
        ) as client:  # fmt: skip
            await plain_rollout(client, Rollout("warm-up", "0000"), 4)
            records_before = len(stack.gateway.gateway.records)
            rollouts = [Rollout(f"plain-{i}", f"N{i:04d}X") for i in range(concurrency)]
            start = time.perf_counter()
            await asyncio.gather(*(plain_rollout(client, r, tokens) for r in rollouts))
            wall = time.perf_counter() - start
            rows.append(latency_row("plain AsyncOpenAI, 2 calls", rollouts, wall, check(stack, rollouts)))

        async def routed(rollout: Rollout) -> None:
            # An agent per rollout: its per-rollout base URL carries the rollout id, no patching.
            url = f"{stack.gateway.base_url}/r/{rollout.rollout_id}/v1"
            await graph_rollout(make_agent(url, tokens), rollout, stack.gateway.gateway.records)

        graphs = [Rollout(f"graph-{i}", f"G{i:04d}Y") for i in range(concurrency)]
        start = time.perf_counter()
        await asyncio.gather(*(routed(r) for r in graphs))
        wall = time.perf_counter() - start
        rows.append(
            latency_row("LangGraph ReAct agent + TrajectoryTracer", graphs, wall, check(stack, graphs))
        )
        total = len(stack.gateway.gateway.records) - records_before
        expected = sum(len(r.completions) for r in rollouts + graphs)
        if total != expected:
            raise SystemExit(f"{total} records for {expected} completions")
    return (
        f"### Load: {concurrency} concurrent rollouts through the gateway (max {tokens} tokens a call; "
        f"{machine()})\n\n"
        + table(
            [
                "rollouts",
                "n",
                "calls checked",
                "lost or mixed",
                "rollout p50 s",
                "rollout p95 s",
                "call p50 s",
                "call p95 s",
                "wall s",
            ],
            rows,
        )
        + "\n\nEach completion a client received was found in the gateway's records exactly once, under"
        " its own rollout id, with its own prompt nonce and the text the client got (the script fails"
        " otherwise). Rollout latency is measured at the client; call latency is each completion's"
        " time in the gateway.\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    arguments = parser.parse_args()
    print(asyncio.run(measure(arguments.concurrency, arguments.tokens)))
