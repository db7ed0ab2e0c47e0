"""Bounded waits on what the code exposes, instead of sleeps tuned to one machine's speed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Return once ``condition()`` holds; fail saying ``what`` was awaited after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.01)
