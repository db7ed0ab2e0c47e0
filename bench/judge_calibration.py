"""Judge calibration on the demo's own groups: how well each local judge ranks attempts that the
programmatic check has scored, and what a judging costs.

Groups: ``--groups`` training questions of the demo, 8 rollouts each by the demo's SmolLM2 agent
(worked examples, T=0.7, adapters merged as the demo serves them), scored by the demo's check (the
right number in the final answer). They are saved to ``--groups-file`` and read back from it on a
later run, so every judge sees the same groups. Pairs are counted where the attempts differ in
success (the target is stated on them); groups whose attempts all succeed or all fail count in
the advantage alignment, where whatever a judge's scores spread there is noise to the trainer.

Then each judge model gets a vLLM server of its own (``LocalBackend.start_judge``: base weights,
eager, no LoRA) and each way of judging in turn:

- ``scores``: RULER, the whole group in one prompt and a JSON score per trajectory (explanations
  off: a 2-core CPU decodes the 1.5B at ~5 tokens/s), in 2 presentations (the second shuffled);
- ``verdict``: each trajectory alone, scored by P(yes) of the reply's first token;
- ``pairwise``: every pair of distinct trajectories in both orders, P(A) of the first token;

each with the method's default rubric and with the demo's task rubric (``--variants`` picks some).
``--reports DIR`` keeps each calibration's JSON report (every trajectory's score) for a second look. Rows are printed as each
is measured. Target for the default local judge: pairwise accuracy >= 85%.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import cast

import journeyman as jm
from bench.common import machine, serving_stack, table
from journeyman.judge import Calibration, Method, calibrate_judge
from journeyman.trajectory import load_group

JUDGES = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
VARIANTS = [
    "scores-default",
    "scores-task",
    "verdict-default",
    "verdict-task",
    "pairwise-default",
    "pairwise-task",
]
GROUP_SIZE = 8


async def collect(questions: int, seed: int) -> list[jm.TrajectoryGroup]:
    """The demo agent's groups on ``questions`` training questions, scored by the demo's check."""
    import httpx
    from langchain_openai import ChatOpenAI

    from journeyman.backend.app.calculator import build_agent, make_scenarios, rollout

    with serving_stack(served_name="base", model="smollm2-135m", merge_adapters=True) as stack:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
            llm = ChatOpenAI(
                model="base", base_url=stack.gateway.base_url + "/v1", api_key="-", temperature=0.7,
                max_tokens=48, disable_streaming=True, max_retries=0, timeout=600, http_async_client=http,
            )  # fmt: skip
            agent = build_agent(llm, worked_examples=True)
            groups = await jm.gather_trajectory_groups(
                (
                    jm.TrajectoryGroup(rollout(agent, s) for _ in range(GROUP_SIZE))
                    for s in make_scenarios(questions, seed=seed)
                ),
                max_exceptions=0.1,
                description="demo rollouts",
            )
    return groups


async def calibrate(
    judge_model: str,
    variants: list[str],
    groups: list[jm.TrajectoryGroup],
    rows: list[tuple[str, ...]],
    reports: Path | None = None,
) -> None:
    from journeyman.backend import LocalBackend
    from journeyman.backend.app.calculator import DEMO_RUBRICS

    with tempfile.TemporaryDirectory(prefix="journeyman-judge-") as tmp:
        async with LocalBackend(root=tmp) as backend:
            start = time.perf_counter()
            judge = await backend.start_judge(
                judge_model, explanation_max_chars=0, timeout=900, max_retries=1, cache=False
            )
            ready = time.perf_counter() - start
            async with judge:
                for variant in variants:
                    method, rubric = variant.split("-")
                    chosen = cast(Method, method)
                    text = DEMO_RUBRICS[chosen] if rubric == "task" else None
                    report = await calibrate_judge(
                        groups, judge, method=chosen, rubric=text, orders=2 if method == "scores" else 1
                    )
                    if reports is not None:  # each trajectory's score, for another look without a judge
                        report.save(reports / f"{judge_model}-{variant}.json")
                    n = len(report.groups)
                    seconds = sum(g.seconds for g in report.groups) / max(n, 1)
                    tokens = sum(g.prompt_tokens for g in report.groups) / max(n, 1)
                    out = sum(g.completion_tokens for g in report.groups) / max(n, 1)
                    rows.append(
                        (
                            judge_model, method, rubric, f"{report.pairs}", _pct(report.pairwise_accuracy),
                            _num(report.kendall_tau), _pct(report.position_consistency),
                            _num(report.first_position_bias), f"{report.ties}", f"{report.failed}",
                            _alignment(report, "group"), _alignment(report, "none"),
                            f"{seconds:.1f}", f"{tokens:.0f} / {out:.0f}", f"{ready:.0f}",
                        )
                    )  # fmt: skip
                    print(f"{judge_model} {variant}:\n{report.table()}", flush=True)


def _alignment(report: Calibration, scale: str) -> str:
    cosine, noise = report.advantage_alignment(scale), report.noise_share(scale)  # type: ignore[arg-type]
    return "-" if cosine is None or noise is None else f"{cosine:.2f} ({100 * noise:.0f}%)"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


HEADER = [
    "judge", "method", "rubric", "pairs", "pairwise accuracy", "Kendall tau", "position consistency",
    "first-position bias", "ties", "failed", "advantage cosine (noise share), group std",
    "advantage cosine (noise share), unscaled", "s / group", "tokens in / out per group", "judge ready s",
]  # fmt: skip


def plot(rows: list[tuple[str, ...]], out: Path) -> Path:
    """Pairwise accuracy and seconds per group of each judge and way of judging, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judges = list(dict.fromkeys(row[0] for row in rows))
    variants = list(dict.fromkeys(f"{row[1]}, {row[2]} rubric" for row in rows))
    figure, (accuracy_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(variants)
    for k, variant in enumerate(variants):
        chosen = {row[0]: row for row in rows if f"{row[1]}, {row[2]} rubric" == variant}
        xs = [i + k * width for i, judge in enumerate(judges) if judge in chosen]
        accuracy_axis.bar(
            xs, [float(chosen[j][4].rstrip("%")) for j in judges if j in chosen], width, label=variant
        )
        time_axis.bar(
            xs,
            [float(chosen[j][HEADER.index("s / group")]) for j in judges if j in chosen],
            width,
            label=variant,
        )
    for axis in (accuracy_axis, time_axis):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(judges))], judges)
    accuracy_axis.axhline(50, color="grey", linestyle=":", label="chance")
    accuracy_axis.axhline(85, color="tab:red", linestyle="--", label="target")
    accuracy_axis.set(ylabel="pairwise accuracy (%)", title="ranking the demo's attempts", ylim=(0, 125))
    time_axis.set(ylabel="seconds per group of 8", title="cost")
    accuracy_axis.legend(fontsize=7, loc="upper center", ncol=3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def rows_from_table(text: str) -> list[tuple[str, ...]]:
    """The rows of a table this script printed (to draw a measured run again)."""
    rows = []
    for line in text.splitlines():
        cells = tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        if len(cells) == len(HEADER) and cells[0] in JUDGES:
            rows.append(cells)
    return list(dict.fromkeys(rows))


async def measure(
    judges: list[str],
    variants: list[str],
    questions: int,
    groups_file: Path,
    seed: int,
    reports: Path | None = None,
) -> str:
    if groups_file.exists():
        groups = [load_group(line) for line in groups_file.read_text().splitlines() if line.strip()]
    else:
        groups = await collect(questions, seed)
        groups_file.parent.mkdir(parents=True, exist_ok=True)
        groups_file.write_text("".join(g.model_dump_json() + "\n" for g in groups))
    success = [t.metrics.get("success", 0) for g in groups for t in g]
    mixed = sum(len({t.metrics.get("success") for t in g}) > 1 for g in groups)
    print(
        f"{len(groups)} groups, {mixed} with successes and failures; success {sum(success) / len(success):.2f}",
        flush=True,
    )
    rows: list[tuple[str, ...]] = []
    for judge_model in judges:
        await calibrate(judge_model, variants, groups, rows, reports)
        print(table(HEADER, rows[-len(variants) :]), flush=True)
    print(f"plot: {plot(rows, Path('bench/judge_calibration.png'))}", flush=True)
    return (
        f"### Judge calibration on the demo's groups ({len(groups)} groups of {GROUP_SIZE} by SmolLM2 with "
        f"worked examples, {mixed} with successes and failures; {machine()})\n\n" + table(HEADER, rows) + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--judge", nargs="+", default=JUDGES)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--groups", type=int, default=12, help="training questions to roll out")
    parser.add_argument("--groups-file", type=Path, default=Path("/tmp/journeyman-judge-groups.jsonl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reports", type=Path, help="a folder for each calibration's JSON report")
    parser.add_argument(
        "--plot-from", type=Path, help="draw the table an earlier run printed; measure nothing"
    )
    args = parser.parse_args()
    if args.plot_from is not None:
        print(plot(rows_from_table(args.plot_from.read_text()), Path("bench/judge_calibration.png")))
    else:
        print(
            asyncio.run(
                measure(args.judge, args.variants, args.groups, args.groups_file, args.seed, args.reports)
            )
        )
