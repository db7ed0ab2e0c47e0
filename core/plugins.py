"""What core calls and the outer packages provide, found without importing them.

Core never imports ``journeyman.integrations`` or ``journeyman.backend``. Where it needs
something they implement, it declares the protocol here and finds the implementation through an
entry point that the installed distribution declares in ``pyproject.toml``:

==========================  =============================================================
``journeyman.exporters``    ``langfuse=`` on gather, train and log: a factory
                            ``(target, **labels) -> Exporter``
``journeyman.exports``      names ``import journeyman`` offers from an outer package
                            (``jm.trainable``)
==========================  =============================================================

Another package can register an exporter of its own under ``journeyman.exporters``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from journeyman.errors import ConfigError
from journeyman.trajectory import TrajectoryGroup

__all__ = ["EXPORTERS", "EXPORTS", "Exporter", "export_groups", "exporter", "load"]

EXPORTERS = "journeyman.exporters"
EXPORTS = "journeyman.exports"


@runtime_checkable
class Exporter(Protocol):
    """Sends finished groups where people read them. A failure is recorded on the group
    (stage ``"export"``), never raised: an export must not stop training."""

    def export_group(self, group: TrajectoryGroup, *, step: int | None = None) -> object: ...


@functools.cache
def load(group: str, name: str) -> Any:
    """The object registered as ``name`` under the entry-point ``group``."""
    found = entry_points(group=group, name=name)
    if not found:
        raise ConfigError(
            f"nothing is registered as {name!r} under the entry points {group!r}: install journeyman "
            "as a package (`pip install -e .` in a checkout) so that its entry points are declared"
        )
    (point, *_) = found
    return point.load()


def exporter(name: str, target: Any, **labels: Any) -> Exporter:
    """The exporter behind ``<name>=target``: ``target`` is True (configured from the environment),
    a client of that service, or an exporter already made."""
    if isinstance(target, Exporter):
        return target
    made: Exporter = load(EXPORTERS, name)(target, **labels)
    return made


async def export_groups(
    exporter: Exporter, groups: Iterable[TrajectoryGroup], *, step: int | None = None
) -> None:
    """Export groups off the event loop; failures end up on the groups, never raised."""
    for group in groups:
        await asyncio.to_thread(exporter.export_group, group, step=step)
