"""Bounded waits on what the code exposes, instead of sleeps tuned to one machine's speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Return once ``condition()`` holds; fail saying ``what`` was awaited after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.01)


def serving(url: str, timeout: float, interval: float = 0.2, request_timeout: float = 5.0) -> bool:
    """Whether ``url``'s ``/health`` answers 200 within ``timeout`` seconds, asked every
    ``interval`` seconds (after a refused connection and after any other answer alike)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=request_timeout).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return False
