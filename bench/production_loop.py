"""What training from production traffic costs on the embedded model: replay of 32 scenarios x 8
attempts and a training step, the gate's held-out evaluation of two versions, and the export of the
step in each format (time, size, and the load-back check). Not a test: numbers for results.md.

    python -m bench.production_loop [--base-model smollm2-135m] [--steps 2] [--judge-model qwen2.5-coder-1.5b]

With ``--judge-model`` each replayed group is also scored by that local judge (verdicts, RULER)
and trained on its scores; the gate still uses the known answer.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import journeyman as jm
from bench.common import machine
from journeyman.backend import LocalBackend
from journeyman.backend.export import CHECK_PROMPTS, check_export, export_step
from journeyman.gate import Gate, promote_if_better
from journeyman.judge import judge_group
from journeyman.replay import Scenario, replay


def scenarios(count: int, seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    found = []
    for _ in range(count):
        a, b = rng.randrange(10, 99), rng.randrange(10, 99)
        message = {"role": "user", "content": f"What is {a} plus {b}? Answer with a number."}
        found.append(Scenario((message,), source=f"trace-{a}-{b}", metadata={"answer": str(a + b)}))
    return found


async def attempt(scenario: Scenario, model: jm.TrainableModel) -> jm.Trajectory:
    @jm.trainable(model)
    async def run(s: Scenario, client) -> float:  # type: ignore[no-untyped-def]
        reply = await client.chat.completions.create(
            messages=list(s.messages), max_tokens=16, temperature=1.0
        )
        return 1.0 if str(s.metadata["answer"]) in (reply.choices[0].message.content or "") else 0.0

    return await run(scenario)


async def main(base_model: str, steps: int, judge_model: str | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="jm-production-"))
    train, held = scenarios(32, seed=0), scenarios(16, seed=1)
    rows = []
    async with LocalBackend(root=root) as backend:
        model = jm.TrainableModel(name="prod", project="bench", base_model=base_model, root=root)
        await model.register(backend)

        after_each = None
        if judge_model is not None:
            judge = await backend.judge(model, judge_model, timeout=600)

            async def after_each(group: jm.TrajectoryGroup) -> jm.TrajectoryGroup:
                return await judge_group(group, judge=judge, method="verdict", reward_from="score")

        async def evaluate(name: str) -> list[jm.TrajectoryGroup]:
            served = model.model_copy(update={"inference_model_name": name})
            return await replay(held, lambda s: attempt(s, served), n=1, progress=False)

        for _ in range(steps):
            started = time.perf_counter()
            groups = await replay(
                train, lambda s: attempt(s, model), n=8, after_each=after_each, progress=False
            )
            replayed = time.perf_counter()
            result = await model.train(groups, jm.TrainConfig(learning_rate=5e-5), promote=False)
            trained = time.perf_counter()
            decision = await promote_if_better(model, result.step, evaluate, Gate(min_delta=-0.05))
            gated = time.perf_counter()
            known = [t.metrics.get("programmatic_reward", t.reward) or 0 for g in groups for t in g]
            reward = sum(known) / len(known)
            rows.append(
                f"| {result.step} | {replayed - started:.1f} | {trained - replayed:.1f} | {gated - trained:.1f} | "
                f"{reward:.2f} | {decision.candidate:.2f} vs {decision.incumbent:.2f}: "
                f"{'promoted' if decision.promoted else 'held'} |"
            )
    judged = f", each group judged by {judge_model} (verdicts; in replay s)" if judge_model else ""
    print(
        f"{machine()}; {base_model}; 32 scenarios x 8 attempts a step{judged}; 16 held out x 1 per version\n"
    )
    print(
        "| step | replay s | train + deploy s | gate s (2 x 16 held out) | known-answer success | "
        "held out: candidate vs promoted |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| format | export s | size MB | check s | greedy equal | largest logit difference |")
    print("|---|---|---|---|---|---|")
    for fmt, kind in (("peft", "f16"), ("hf", "f16"), ("gguf", "f16"), ("gguf", "q8_0")):
        out = root / "exports" / f"{fmt}-{kind}"
        export = export_step(model.store, out, format=fmt, gguf_type=kind)  # type: ignore[arg-type]
        started = time.perf_counter()
        check = check_export(export, CHECK_PROMPTS)
        name = fmt if fmt != "gguf" else f"gguf {kind}"
        print(
            f"| {name} | {export.seconds:.1f} | {export.bytes / 2**20:.1f} | {time.perf_counter() - started:.1f} | "
            f"{check.greedy_equal} of {check.prompts} | {check.max_logit_diff:.3f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--judge-model", default=None)
    args = parser.parse_args()
    asyncio.run(main(args.base_model, args.steps, args.judge_model))
