"""``journeyman sft``: a supervised run on a model's adapter, from JSONL files or a run's best groups."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import journeyman as jm
from journeyman.config import Schedule
from journeyman.errors import ConfigError
from journeyman.sft import best_trajectories, read_chat_jsonl, stored_groups
from journeyman.store import ModelStore
from journeyman.trajectory import format_validation_error

from .cli_runs import Root


def sft(
    project: str,
    model: str,
    data: Annotated[
        list[Path] | None,
        typer.Option("--data", help="A JSONL of conversations in OpenAI's fine-tuning format (repeatable)."),
    ] = None,
    from_run: Annotated[
        str | None,
        typer.Option(help="PROJECT/MODEL: learn from the best trajectories of this stored run's groups."),
    ] = None,
    split: Annotated[str, typer.Option(help="The stored run's split to read (--from-run).")] = "train",
    per_group: Annotated[int, typer.Option(help="Best trajectories kept per group (--from-run).")] = 1,
    min_reward: Annotated[
        float | None, typer.Option(help="Keep only trajectories with at least this reward (--from-run).")
    ] = None,
    eval_data: Annotated[
        list[Path] | None,
        typer.Option("--eval-data", help="A JSONL of conversations for the validation loss (repeatable)."),
    ] = None,
    base_model: Annotated[
        str, typer.Option(help="The base model (an embedded alias or a folder).")
    ] = "smollm2-135m",
    epochs: Annotated[int, typer.Option(help="Passes over the conversations.")] = 1,
    learning_rate: Annotated[float, typer.Option(help="AdamW's peak learning rate.")] = 1e-4,
    batch_size: Annotated[int, typer.Option(help="Conversations per optimizer step.")] = 8,
    schedule: Annotated[str, typer.Option(help=f"{', '.join(get_args(Schedule))}.")] = "cosine",
    warmup_ratio: Annotated[float, typer.Option(help="Share of the batches spent warming up.")] = 0.0,
    eval_fraction: Annotated[
        float, typer.Option(help="Share of the conversations held out for the validation loss.")
    ] = 0.0,
    early_stopping_patience: Annotated[
        int | None, typer.Option(help="Stop after this many validation losses that do not beat the best.")
    ] = None,
    max_seq_len: Annotated[int, typer.Option(help="Longest conversation, in tokens.")] = 4096,
    overlong: Annotated[
        str, typer.Option(help="A longer conversation: error, truncate or exclude.")
    ] = "error",
    seed: Annotated[int, typer.Option(help="Seeds the order, the held-out draw and a new adapter.")] = 0,
    root: Root = None,
) -> None:
    """Train MODEL's adapter on conversations by imitation (cross-entropy on the assistant turns),
    as its next step: the next `journeyman serve` or training run goes on from it."""
    trajectories = _data(data, from_run, split, per_group, min_reward, root)
    evaluation = [t for path in eval_data or [] for t in read_chat_jsonl(path)] or None
    try:
        config = jm.SFTConfig.model_validate(
            {"learning_rate": learning_rate, "epochs": epochs, "batch_size": batch_size, "schedule": schedule,
             "warmup_ratio": warmup_ratio, "eval_fraction": eval_fraction, "max_seq_len": max_seq_len,
             "early_stopping_patience": early_stopping_patience, "overlong": overlong, "seed": seed}
        )  # fmt: skip
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "sft option")) from None
    store = ModelStore(project, model, root=root)
    typer.echo(f"{len(trajectories)} conversations -> {store.path}")
    result = asyncio.run(_train(store, base_model, trajectories, evaluation, config))
    metrics = result.metrics
    line = f"step {result.step}: {int(metrics['sft/batches'])} batches, loss {metrics['sft/loss']:.4f}"
    if "sft/val_loss" in metrics:
        line += f", validation loss {metrics['sft/val_loss_before']:.4f} -> {metrics['sft/val_loss']:.4f}"
        line += " (stopped early)" if metrics["sft/stopped_early"] else ""
    typer.echo(line)
    typer.echo(f"adapter: {store.checkpoint_path(result.step)}")


def _data(
    data: list[Path] | None,
    from_run: str | None,
    split: str,
    per_group: int,
    min_reward: float | None,
    root: Path | None,
) -> list[jm.Trajectory]:
    if not data and from_run is None:
        raise ConfigError("give --data FILE.jsonl (repeatable) or --from-run PROJECT/MODEL")
    trajectories = [t for path in data or [] for t in read_chat_jsonl(path)]
    if from_run is not None:
        project, _, name = from_run.partition("/")
        if not name:
            raise ConfigError(f"--from-run takes PROJECT/MODEL, got {from_run!r}")
        run = ModelStore(project, name, root=root)
        groups = stored_groups(run, split)
        if not groups:
            raise ConfigError(f"no {split!r} groups stored at {run.path}: check the run's name and --root")
        best = best_trajectories(groups, per_group=per_group, min_reward=min_reward)
        typer.echo(f"{from_run}: {len(best)} trajectories from {len(groups)} {split} groups")
        trajectories += best
    return trajectories


async def _train(
    store: ModelStore,
    base_model: str,
    trajectories: list[jm.Trajectory],
    evaluation: list[jm.Trajectory] | None,
    config: jm.SFTConfig,
) -> Any:
    from journeyman.backend.training.trainer import Trainer

    trainer = Trainer(base_model, store, seed=config.seed)
    columns = (
        TextColumn("sft"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("sft", total=None, loss="loading the model")

        def advance(row: dict[str, Any], total: int) -> None:
            validation = f", validation {row['sft/val_loss']:.4f}" if "sft/val_loss" in row else ""
            progress.update(
                task, total=total, completed=row["sft/batch"], loss=f"loss {row['sft/loss']:.4f}{validation}"
            )

        return await trainer.train_sft(trajectories, config, evaluation, advance)
