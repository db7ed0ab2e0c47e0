"""The commands that read a run store: checkpoints, curves, trajectories, judge calibration."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, cast, get_args

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from journeyman.errors import JourneymanError
from journeyman.messages import content_text
from journeyman.store import CHECKPOINT_STATE, ModelStore

from .plots import plot_history

checkpoints_app = typer.Typer(help="A model's checkpoints: list, prune.", no_args_is_help=True)
trajectories_app = typer.Typer(help="Stored trajectories: show them readably.", no_args_is_help=True)
judge_app = typer.Typer(help="LLM judges: calibrate one on stored groups.", no_args_is_help=True)

Root = Annotated[Path | None, typer.Option(help="Store root (default: $JOURNEYMAN_ROOT or ./.journeyman).")]
ReportTo = Annotated[
    list[str] | None,
    typer.Option(
        help="An experiment tracker that follows each run: wandb, tensorboard or mlflow (repeatable; "
        "default: wandb when WANDB_API_KEY is set)."
    ),
]


@checkpoints_app.command("list")
def checkpoints_list(project: str, model: str, root: Root = None) -> None:
    """Steps with a complete checkpoint, their size and the metrics they were saved with."""
    store = ModelStore(project, model, root=root)
    steps = store.checkpoint_steps()
    promoted = store.promoted_step()
    promoted = steps[-1] if promoted is None and steps else promoted
    table = Table("step", "size MB", "reward/mean", "train/loss", "served as the plain name")
    for step in steps:
        folder = store.checkpoint_path(step)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
        state = folder / CHECKPOINT_STATE
        metrics = json.loads(state.read_text()).get("metrics", {}) if state.is_file() else {}
        table.add_row(
            str(step), f"{size:.1f}", _fmt(metrics.get("reward/mean")), _fmt(metrics.get("train/loss")),
            "promoted" if step == promoted else "",
        )  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    decisions = [row for row in store.read_promotions() if row.get("by") != "train"]
    if decisions:  # promotions by hand or by a gate, and holds (each train step's own is left out)
        log = Table("time", "action", "step", "from step", "by", "gate: candidate / promoted (min delta)")
        for row in decisions:
            gate = row.get("gate") or {}
            numbers = (
                f"{gate['candidate']:.3f} / {gate['incumbent']:.3f} ({gate['min_delta']:+.3f}), n={gate['samples']}"
                if gate else f"share {row['share']:.0%} of rollouts" if "share" in row else ""
            )  # fmt: skip
            log.add_row(
                str(row.get("time", ""))[:19], row["action"], str(row["step"]), str(row.get("from_step", "")),
                str(row.get("by", "")), numbers,
            )  # fmt: skip
        console.print(log)


@checkpoints_app.command("prune")
def checkpoints_prune(
    project: str,
    model: str,
    best_metric: Annotated[
        str, typer.Option(help="History metric that picks the best step to keep.")
    ] = "val/reward",
    lower_is_better: Annotated[
        bool, typer.Option(help="Keep the step with the lowest value instead.")
    ] = False,
    root: Root = None,
) -> None:
    """Delete every checkpoint but the latest and the best."""
    store = ModelStore(project, model, root=root)
    deleted = store.prune_checkpoints(best_metric, higher_is_better=not lower_is_better)
    typer.echo(f"deleted steps {deleted}; kept {store.checkpoint_steps()}")


def track(
    project: str,
    model: str,
    to: Annotated[
        list[str],
        typer.Option(
            "--to", help="A tracker to write the run to: wandb, tensorboard or mlflow (repeatable)."
        ),
    ],
    root: Root = None,
) -> None:
    """Write a whole stored run to experiment trackers as one new run: every history row, a sample
    of each step's trajectories, every checkpoint and the promotions' aliases (a run resumed
    offline, which W&B keeps as several runs, becomes one)."""
    from journeyman.trackers import TrackerSync, make_trackers

    store = ModelStore(project, model, root=root)
    if not store.history_path.is_file():
        raise typer.BadParameter(
            f"no run at {store.path}: give the project and model a run stored (and --root)"
        )
    sync = TrackerSync(
        store, make_trackers(to), config={"project": project, "model": model}, keep_state=False
    )
    with Console(stderr=True).status(f"writing {store.path} to {', '.join(to)}"):
        sync.close()
    for name, run_id in sync.run_ids().items():
        failed = sync.failures[name]
        typer.echo(f"{name}: {'FAILED, see the log above' if failed else 'run ' + str(run_id)}")
    if any(sync.failures.values()):
        raise typer.Exit(1)


def plot(
    project: str,
    model: str,
    out: Annotated[
        Path | None, typer.Option(help="PNG to write (default: <model folder>/curves.png).")
    ] = None,
    root: Root = None,
) -> None:
    """Reward and loss per step from history.jsonl, as a PNG."""
    store = ModelStore(project, model, root=root)
    path = plot_history(store.read_history(), out or store.path / "curves.png", title=f"{project}/{model}")
    typer.echo(str(path))


@trajectories_app.command("show")
def trajectories_show(
    project: str,
    model: str,
    split: Annotated[str, typer.Option(help="train, val, ...")] = "train",
    step: Annotated[int | None, typer.Option(help="Step (default: the latest stored).")] = None,
    limit: Annotated[int, typer.Option(help="Trajectories to show.")] = 3,
    root: Root = None,
) -> None:
    """Print stored trajectories as readable conversations."""
    store = ModelStore(project, model, root=root)
    chosen = _stored_steps(store, split)[-1] if step is None else step
    console = Console()
    shown = 0
    for index, group in enumerate(store.load_groups(split, chosen)):
        for trajectory in group:
            if shown == limit:
                return
            shown += 1
            console.rule(f"step {chosen} · group {index} · reward {_fmt(trajectory.reward)}")
            for message in trajectory.messages:
                text = content_text(message.content) if message.content is not None else ""
                calls = getattr(message, "tool_calls", None) or []
                for call in calls:
                    text += f"\n→ {call.function.name}({call.function.arguments})"
                console.print(f"[bold]{message.role}[/bold]: {escape(text)}")
            for line in trajectory.logs:
                console.print(f"[dim]log: {escape(line)}[/dim]")
        for failure in group.failures:
            console.print(f"[red]failure ({failure.stage}): {failure.type}: {escape(failure.message)}[/red]")


@judge_app.command("calibrate")
def judge_calibrate(
    project: str,
    model: str,
    judge_model: Annotated[str, typer.Option(help="The judge's model name at --judge-base-url.")],
    judge_base_url: Annotated[
        str,
        typer.Option(
            help="OpenAI-compatible endpoint of the judge (key: $JOURNEYMAN_JUDGE_API_KEY or $OPENAI_API_KEY)."
        ),
    ],
    split: Annotated[str, typer.Option(help="train, val, ...")] = "train",
    step: Annotated[
        list[int] | None, typer.Option(help="Step to read (repeatable; default: every stored step).")
    ] = None,
    max_groups: Annotated[int | None, typer.Option(help="Calibrate on at most this many groups.")] = None,
    method: Annotated[
        str,
        typer.Option(
            help="auto (verdict where the judge returns logprobs, else scores), scores (RULER: the group "
            "in one prompt), verdict (P(yes) per trajectory) or pairwise (every pair in both orders)."
        ),
    ] = "auto",
    orders: Annotated[
        int | None,
        typer.Option(help="Presentations of each group, each in another order (default: 3, verdict 1)."),
    ] = None,
    labels: Annotated[
        Path | None,
        typer.Option(
            help='JSONL of {"trajectory_id": ..., "reward": ...}: the truth instead of the stored rewards.'
        ),
    ] = None,
    rubric: Annotated[
        Path | None, typer.Option(help="A file holding the rubric (default: the method's own).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="JSON report (default: <model folder>/calibration/<judge>.json).")
    ] = None,
    reference: Annotated[
        bool,
        typer.Option(
            help="The judge first writes how each task should be done, then checks the attempts against it."
        ),
    ] = False,
    probes: Annotated[
        bool,
        typer.Option(
            help="Also judge probes of each success (its final answer without the tool calls before it; "
            "its tool calls without the answer) and count how often the success scores higher."
        ),
    ] = False,
    fail_at_chance: Annotated[
        bool, typer.Option(help="Exit with status 2 when the judge ranks no better than chance.")
    ] = False,
    root: Root = None,
) -> None:
    """How well a judge ranks stored groups against their known rewards (or your labels)."""
    import asyncio
    import os

    import journeyman as jm
    from journeyman.calibration import known_reward
    from journeyman.judge import Calibration, Judge, Method, calibrate_judge

    if method not in get_args(Method):
        raise typer.BadParameter(f"--method must be auto, scores, verdict or pairwise, got {method!r}")
    store = ModelStore(project, model, root=root)
    steps = step or _stored_steps(store, split)
    groups = [group for chosen in steps for group in store.load_groups(split, chosen)][:max_groups]
    given = _read_labels(labels) if labels is not None else None

    def truth(trajectory: jm.Trajectory) -> float | None:
        return known_reward(trajectory) if given is None else given.get(trajectory.id)

    key = os.environ.get("JOURNEYMAN_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    text = rubric.read_text() if rubric is not None else None

    async def calibrate() -> Calibration:
        judge = Judge(judge_model, base_url=judge_base_url, api_key=key, cache_dir=store.root / "judge_cache")
        async with judge:
            return await calibrate_judge(
                groups, judge, orders=orders, rubric=text, method=cast(Method, method), truth=truth,
                reference=reference, probes=probes,
            )  # fmt: skip

    with Console(stderr=True).status(f"judging {len(groups)} groups with {judge_model} ({method})"):
        report = asyncio.run(calibrate())
    typer.echo(report.table())
    path = report.save(out or store.path / "calibration" / f"{judge_model.replace('/', '_')}.json")
    typer.echo(f"report: {path}")
    if fail_at_chance and not report.better_than_chance():
        raise typer.Exit(2)


def export(
    project: str,
    model: str,
    out: Annotated[Path, typer.Argument(help="A new (or empty) folder to write the export into.")],
    step: Annotated[int | None, typer.Option(help="Step to export (default: the latest checkpoint).")] = None,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf (a merged Hugging Face folder), peft (the LoRA adapter) or gguf (one file for "
            "llama.cpp and Ollama, with a Modelfile).",
        ),
    ] = "hf",
    gguf_type: Annotated[str, typer.Option(help="GGUF matrices: f16, q8_0 or f32.")] = "f16",
    check: Annotated[
        bool,
        typer.Option(
            help="Load the export back and compare its greedy text and logits with the checkpoint on a "
            "few prompts (transformers; a minute or two on CPU)."
        ),
    ] = True,
    root: Root = None,
) -> None:
    """Write a trained step as a merged Hugging Face folder, a PEFT adapter or a GGUF file."""
    from journeyman.backend.export import CHECK_PROMPTS, check_export, export_step

    store = ModelStore(project, model, root=root)
    with Console(stderr=True).status(f"exporting {project}/{model} as {format}"):
        result = export_step(store, out, step=step, format=format, gguf_type=gguf_type)  # type: ignore[arg-type]
    typer.echo(f"step {result.step} -> {result.path} ({result.bytes / 2**20:.1f} MB, {result.seconds:.1f} s)")
    if not check:
        return
    with Console(stderr=True).status(
        f"loading {result.main_file.name} back and comparing it with step {result.step}"
    ):
        report = check_export(result, CHECK_PROMPTS)
    typer.echo(
        f"check: greedy text equal on {report.greedy_equal} of {report.prompts} prompts; "
        f"largest logit difference {report.max_logit_diff:.4f}"
    )
    for reference, exported in report.texts:
        if reference != exported:
            typer.echo(f"  step:   {reference!r}\n  export: {exported!r}")
    if report.lossy and report.greedy_equal < report.prompts:
        typer.echo(f"  ({result.gguf_type} rounds the weights: a nearly tied token may part ways)")
    if not report.ok:
        raise typer.Exit(2)


Url = Annotated[
    str | None,
    typer.Option(
        envvar="JOURNEYMAN_URL",
        help="A running `journeyman serve` to move the name on now (token: --token or $JOURNEYMAN_TOKEN). "
        "Without it the move is recorded in the store and served from the model's next registration.",
    ),
]
Token = Annotated[str | None, typer.Option(envvar="JOURNEYMAN_TOKEN", help="The server's bearer token.")]


def promote(
    project: str, model: str, step: int, url: Url = None, token: Token = None, root: Root = None
) -> None:
    """Point a model's plain name (what production calls) at STEP, and record who did it."""
    typer.echo(_move(project, model, step, "promote", url, token, root))


def rollback(
    project: str,
    model: str,
    step: Annotated[
        int | None,
        typer.Option(help="Step to go back to (default: the one promoted before the current one)."),
    ] = None,
    url: Url = None,
    token: Token = None,
    root: Root = None,
) -> None:
    """Point a model's plain name back at an earlier step, and record who did it."""
    typer.echo(_move(project, model, -1 if step is None else step, "rollback", url, token, root))


def canary(
    project: str,
    model: str,
    step: int,
    share: Annotated[
        float, typer.Option(help="Share of rollouts (0-1) the step answers; 0 ends the canary.")
    ],
    url: Annotated[str, typer.Option(envvar="JOURNEYMAN_URL", help="The running `journeyman serve`.")],
    token: Token = None,
) -> None:
    """Send a share of a model's rollouts (each whole, by rollout id) to STEP on a running server."""
    typer.echo(_move(project, model, step, "canary", url, token, None, share=share))


def _move(
    project: str, model: str, step: int, action: str, url: str | None, token: str | None, root: Path | None,
    share: float | None = None,
) -> str:  # fmt: skip
    from journeyman.backend.local import move_target
    from journeyman.model import who

    body: dict[str, Any] = {"step": step, "action": action, "by": who(), "gate": None, "share": share}
    if url is not None:
        import httpx

        headers = {"authorization": f"Bearer {token}"} if token else {}
        response = httpx.post(
            f"{url.rstrip('/')}/api/models/{project}/{model}/promoted",
            json=body,
            headers=headers,
            timeout=600,
        )
        if response.status_code != 200:
            raise JourneymanError(f"{url} answered {response.status_code}: {response.text[:500]}")
        if action == "canary":
            return f"{share:.0%} of {model}'s rollouts go to step {step} ({url})"
        return f"{model} now answers as step {response.json()['step']} ({url})"
    store = ModelStore(project, model, root=root)
    steps = store.checkpoint_steps()
    step, current = move_target(store, step, action, latest=steps[-1] if steps else None)
    store.append_promotion(
        {k: v for k, v in {**body, "step": step, "from_step": current}.items() if v is not None}
    )
    return (
        f"recorded: {model} answers as step {step} from its next registration (no --url: no server was told)"
    )


def _stored_steps(store: ModelStore, split: str) -> list[int]:
    """The steps with stored trajectories for ``split``; an error when there are none."""
    steps = store.steps(split)
    if not steps:
        raise JourneymanError(f"no trajectories stored for split {split!r} in {store.path}")
    return steps


def _read_labels(path: Path) -> dict[str, float]:
    """Trajectory id -> reward, from a JSONL file; an error names the line that is wrong."""
    labels = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            labels[str(row["trajectory_id"])] = float(row["reward"])
        except (ValueError, KeyError, TypeError) as error:
            raise JourneymanError(
                f'{path}, line {number}: expected {{"trajectory_id": "...", "reward": <number>}} ({error!r})'
            ) from None
    return labels


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"
