"""The ``journeyman`` command line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from journeyman.errors import JourneymanError

from .models import EMBEDDED_MODELS, prepare_model

app = typer.Typer(help="journeyman: on-the-job RL for the LLM agents you already run.", no_args_is_help=True)
model_app = typer.Typer(help="Base models: prepare the embedded default.", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("prepare")
def model_prepare(
    name: Annotated[
        str, typer.Argument(help=f"Embedded model alias: {', '.join(EMBEDDED_MODELS)}.")
    ] = "smollm2-135m",
    cache_dir: Annotated[
        Path | None, typer.Option(help="Folder for converted models (default: $JOURNEYMAN_HOME/models).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Convert again even when a matching folder exists.")] = False,
) -> None:
    """Convert an embedded model into a Hugging Face folder (once; later runs do nothing)."""
    folder = prepare_model(name, cache_dir, force=force)
    typer.echo(str(folder))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except JourneymanError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise SystemExit(1) from None
