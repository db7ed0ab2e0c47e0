"""Gateway overhead per completion: the same requests straight to vLLM and through the gateway.

Requests alternate between the two paths so both see the same machine state. Two views:
client-observed latency of each path, and the time the gateway adds around its upstream call
(client-observed total minus the upstream time the gateway measured and recorded).
Target: <= 3 ms added at the median.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from bench.common import machine, serving_stack, summary, table

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}


async def measure(requests: int) -> str:
    with serving_stack(served_name="base") as stack:
        direct_url = stack.server.base_url + "/v1/chat/completions"
        gateway_url = stack.gateway.base_url + "/v1/chat/completions"
        direct, through, added = [], [], []
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(5):  # warm both paths
                await client.post(direct_url, json={**BODY, "model": "base"})
                await client.post(gateway_url, json={**BODY, "model": "base"})
            for _ in range(requests):
                start = time.perf_counter()
                (await client.post(direct_url, json={**BODY, "model": "base"})).raise_for_status()
                direct.append(time.perf_counter() - start)
                start = time.perf_counter()
                response = await client.post(gateway_url, json={**BODY, "model": "base"})
                total = time.perf_counter() - start
                response.raise_for_status()
                record = stack.gateway.gateway.records.get(response.json()["id"])
                assert record is not None
                through.append(total)
                added.append(total - record.upstream_seconds)
    rows = [
        ("vLLM directly", *summary(direct)),
        ("through the gateway", *summary(through)),
        ("added by the gateway (total - recorded upstream time)", *summary(added)),
    ]
    return (
        f"### Gateway overhead ({requests} sequential 1-token chat completions per path; {machine()})\n\n"
        + table(["path", "p50 ms", "p95 ms", "mean ms"], rows)
        + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    print(asyncio.run(measure(parser.parse_args().requests)))
