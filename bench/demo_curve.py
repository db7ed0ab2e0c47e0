"""The demo's learning curve: `journeyman demo` with its default settings, one full run.

Prints a markdown section (before/after held-out table, success per step) and copies the curve
to bench/demo_curve.png. One run takes about half an hour on 2 cores, so it is not repeated.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, table
from journeyman.backend.app.demo import DemoConfig, run_demo
from journeyman.store import ModelStore

PNG = Path(__file__).with_name("demo_curve.png")


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.0%}"


def _every_few(rows: list[dict[str, Any]], shown: int = 12) -> list[dict[str, Any]]:
    """About ``shown`` of the steps' rollout rows, evenly spaced, the last one included."""
    steps = [r for r in rows if r.get("split") == "rollouts"]
    every = max(1, -(-len(steps) // shown))
    return [r for i, r in enumerate(steps) if i % every == 0 or i == len(steps) - 1]


def section(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    config, before, after = report["config"], report["before"], report["after"]
    evaluation = [
        (f"success, T={config['temperature']}", "sampled", "success"),
        ("word problems", "sampled", "success_word"),
        ("arithmetic", "sampled", "success_arithmetic"),
        ("valid tool call", "sampled", "valid_tool_call"),
        ("right tool and numbers", "sampled", "right_tool_call"),
        ("success, greedy", "greedy", "success"),
        ("word problems, greedy", "greedy", "success_word"),
        ("calls a tool with no worked examples (greedy)", "zero_shot", "tool_call"),
        ("success with no worked examples (greedy)", "zero_shot", "success"),
    ]
    lines = [
        f"### Demo learning curve (`journeyman demo`; {machine()})",
        "",
        f"{report['after']['step'] - report['before']['step']} steps x {config['scenarios_per_step']} questions x groups of {config['group_size']}, "
        f"loss {config['loss']}, learning rate {config['learning_rate']}, LoRA rank {config['rank']}, "
        f"temperature {config['temperature']}; held-out: {config['val_scenarios']} questions x "
        f"{config['val_samples']} samples, plus one greedy. Training took {report['train_minutes']:.1f} min "
        f"({report['total_minutes']:.1f} min with vLLM start and both evaluations).",
        "",
        table(
            ["held-out", f"before (step {before['step']})", f"after (step {after['step']})"],
            [
                (label, _pct(before[part].get(key)), _pct(after[part].get(key)))
                for label, part, key in evaluation
            ],
        ),
        "",
        table(
            ["step", "rollout success (new questions)", "word problems", "valid tool calls", "minutes"],
            [
                (
                    r["step"] + 1,
                    _pct(r.get("rollouts/success")),
                    _pct(r.get("rollouts/success_word")),
                    _pct(r.get("rollouts/valid_tool_call")),
                    f"{r['elapsed_s'] / 60:.1f}",
                )
                for r in _every_few(rows)
            ],
        ),
        "",
        f"![demo learning curve]({PNG.name})",
        "",
        report["summary"],
    ]
    return "\n".join(lines)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="journeyman-demo-bench-") as tmp:
        report = run_demo(DemoConfig(root=Path(tmp), name="bench", progress=False))
        rows = ModelStore("demo", "bench", root=Path(tmp)).read_history()
        shutil.copyfile(report["png"], PNG)
    print(section(report, rows))


if __name__ == "__main__":
    main()
