"""Run every benchmark and write bench/results.md (``make bench``)."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

from bench import gateway_overhead, redeploy_latency, rl_step, rollout_throughput, train_throughput
from bench.common import machine

RESULTS = Path(__file__).with_name("results.md")


async def main() -> None:
    sections = [
        await gateway_overhead.measure(200),
        await redeploy_latency.measure(10),
        await rollout_throughput.measure(["auto", "0-1"], 2),
        await asyncio.to_thread(train_throughput.measure, 2, 8, 3),
        await asyncio.to_thread(rl_step.measure),
    ]
    header = f"# Benchmark results\n\nMeasured {datetime.date.today()} on {machine()} by `make bench`.\n\n"
    RESULTS.write_text(header + "\n".join(sections))
    print(RESULTS.read_text())


if __name__ == "__main__":
    asyncio.run(main())
