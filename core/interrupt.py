"""Ctrl-C for long async runs: the first press stops the run, even where a library loses it.

``asyncio.run`` turns a first SIGINT into ``main_task.cancel()``, and a library that swallows
that cancellation lets the run go on as if the key was never pressed. The gather and LangGraph
do not lose it; AnyIO's cancel scopes, under every httpx call, can swallow a native cancellation
that lands in the same loop iteration as their own (agronholm/anyio#1214, open). :class:`Interrupt` keeps
the press itself, so the run also stops at its next :meth:`check`. A second press raises
``KeyboardInterrupt`` at once, as ``asyncio.run`` does.
"""

from __future__ import annotations

import asyncio
import signal
from types import TracebackType

__all__ = ["Interrupt"]


class Interrupt:
    """``async with Interrupt() as interrupt:`` in the main task; ``interrupt.check()`` between
    units of work raises ``asyncio.CancelledError`` once Ctrl-C was pressed."""

    def __init__(self) -> None:
        self.presses = 0
        self._task: asyncio.Task[object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Interrupt:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        try:
            self._loop.add_signal_handler(signal.SIGINT, self._pressed)
        except (NotImplementedError, RuntimeError, ValueError):  # no signals here (a thread, Windows)
            self._loop = None
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)
            self._loop = None

    def _pressed(self) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt
        if self._task is not None:
            self._task.cancel("Ctrl-C")

    def check(self) -> None:
        """Raise ``CancelledError`` if Ctrl-C was pressed (its cancellation may have been lost)."""
        if self.presses:
            raise asyncio.CancelledError("Ctrl-C")
