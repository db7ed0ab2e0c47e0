"""Ctrl-C in the demo: a first press that a library swallows still stops the run at the next check."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from journeyman.backend.app.interrupt import Interrupt


async def _swallowing_call() -> str:
    """What AnyIO does to a native cancellation in agronholm/anyio#1214: the call returns normally."""
    try:
        await asyncio.sleep(5)
    except asyncio.CancelledError:
        return "returned as if not cancelled"
    return "slept"


def test_a_swallowed_first_press_stops_the_run_at_the_next_check() -> None:
    steps: list[str] = []

    async def run() -> None:
        async with Interrupt() as interrupt:
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            steps.append(await _swallowing_call())
            interrupt.check()
            steps.append("the next step")

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    assert steps == ["returned as if not cancelled"]


def test_a_first_press_cancels_what_is_running() -> None:
    async def run() -> None:
        async with Interrupt() as interrupt:
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            await asyncio.sleep(5)
            interrupt.check()

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(run())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back


def test_a_second_press_raises_keyboard_interrupt_at_once() -> None:
    async def run() -> None:
        async with Interrupt():
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, os.kill, os.getpid(), signal.SIGINT)
            loop.call_later(0.10, os.kill, os.getpid(), signal.SIGINT)
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:  # a clean-up that takes long
                await asyncio.sleep(5)

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(run())
