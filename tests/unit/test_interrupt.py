"""Ctrl-C in the demo: a first press that a library swallows still stops the run at the next check.

Each case sends a real SIGINT, so it runs in a child interpreter: a press that :class:`Interrupt`
let through as ``KeyboardInterrupt`` ends that child and fails one test, not the pytest session.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from journeyman.interrupt import Interrupt

ROOT = Path(__file__).resolve().parents[2]


def _in_child(scenario: Callable[[], object]) -> object:
    """What ``scenario()`` returns, run in a fresh interpreter (its SIGINTs reach only that one)."""
    code = f"import json, tests.unit.test_interrupt as t; print(json.dumps(t.{scenario.__name__}()))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.splitlines()[-1])


def _ended(run: Callable[[], Coroutine[Any, Any, None]]) -> str:
    """How ``asyncio.run(run())`` ended: "returned", or the name of what it raised."""
    try:
        asyncio.run(run())
    except BaseException as error:  # KeyboardInterrupt too: the child reports it instead of dying
        return type(error).__name__
    return "returned"


async def _swallowing_call() -> str:
    """What AnyIO does to a native cancellation in agronholm/anyio#1214: the call returns normally."""
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        return "returned as if not cancelled"
    return "slept"


def _swallowed_first_press() -> object:
    steps: list[str] = []

    async def run() -> None:
        async with Interrupt() as interrupt:
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            steps.append(await _swallowing_call())
            interrupt.check()
            steps.append("the next step")

    return [_ended(run), steps]


def test_a_swallowed_first_press_stops_the_run_at_the_next_check() -> None:
    assert _in_child(_swallowed_first_press) == ["CancelledError", ["returned as if not cancelled"]]


def _first_press() -> object:
    async def run() -> None:
        async with Interrupt() as interrupt:
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            await asyncio.sleep(5)
            interrupt.check()

    return [_ended(run), signal.getsignal(signal.SIGINT) is signal.default_int_handler]


def test_a_first_press_cancels_what_is_running() -> None:
    assert _in_child(_first_press) == ["CancelledError", True]  # and the handler is handed back


def _second_press() -> object:
    async def run() -> None:
        async with Interrupt():
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            loop.call_later(0.10, os.kill, os.getpid(), signal.SIGINT)
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:  # a clean-up that takes long
                await asyncio.sleep(5)

    return _ended(run)


def test_a_second_press_raises_keyboard_interrupt_at_once() -> None:
    assert _in_child(_second_press) == "KeyboardInterrupt"
