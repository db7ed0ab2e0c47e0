"""The pictures: ``journeyman plot``'s curves and the demo's, drawn with matplotlib (the bench extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from journeyman.errors import JourneymanError, MissingDependencyError

__all__ = ["plot_demo", "plot_history", "pyplot", "save"]


def pyplot() -> Any:
    """matplotlib.pyplot, drawing to files only (an error says to install the bench extra)."""
    try:
        import matplotlib
    except ImportError as error:
        raise MissingDependencyError("matplotlib", "bench", "drawing curves") from error
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def save(figure: Any, out: Path, dpi: int = 100) -> Path:
    """Lay ``figure`` out, write it to ``out`` (its folder made) and close it."""
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=dpi)
    pyplot().close(figure)
    return out


def plot_history(rows: list[dict[str, object]], out: Path, title: str = "") -> Path:
    """Reward (train and val) and loss against the step; written to ``out``."""
    plt = pyplot()

    if not rows:
        raise JourneymanError("history.jsonl is empty: train or log at least one step first")
    figure, (reward_axis, loss_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in [("reward/mean", "train reward"), ("val/reward", "val reward")]:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            reward_axis.plot(*zip(*points, strict=True), marker="o", label=label)
    loss = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    if loss:
        loss_axis.plot(*zip(*loss, strict=True), marker="o", color="tab:red")
    from matplotlib.ticker import MaxNLocator

    for axis in (reward_axis, loss_axis):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    reward_axis.set(xlabel="step", ylabel="reward", title="reward")
    reward_axis.legend()
    loss_axis.set(xlabel="step", ylabel="loss", title="train loss")
    figure.suptitle(title)
    return save(figure, out)


def plot_demo(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Rollout success per training step, with the held-out success before and after."""
    plt = pyplot()

    figure, axis = plt.subplots(figsize=(7, 4))
    rows = sorted(rows, key=lambda r: r.get("step", 0))  # a row restored on resume comes after later steps
    train = [(r["step"], r["rollouts/success"]) for r in rows if "rollouts/success" in r]
    if train:
        axis.plot(*zip(*train, strict=True), marker="o", label="training rollouts (new questions)")
    zero_shot = [
        (r["step"], r["rollouts/success_zero_shot"]) for r in rows if "rollouts/success_zero_shot" in r
    ]
    if zero_shot:
        axis.plot(*zip(*zero_shot, strict=True), marker=".", label="training rollouts, no worked examples")
    for key, label, marker in [
        ("val/success", "held-out, sampled", "s"),
        ("val_greedy/success", "held-out, greedy", "^"),
        ("val/success_word", "held-out word problems", "v"),
        ("val_zero_shot_sampled/success", "held-out, no worked examples, sampled", "D"),
    ]:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            axis.plot(*zip(*points, strict=True), marker=marker, linestyle="--", label=label)
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(
        xlabel="model version (training steps done)", ylabel="success rate", ylim=(-0.02, 1.02), title=title
    )
    axis.legend(loc="lower right", fontsize=8)
    return save(figure, out)
