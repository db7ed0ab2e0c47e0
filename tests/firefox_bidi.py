"""Just enough WebDriver BiDi to drive Debian's Firefox ESR in the viewer's tests.

Playwright drives only its own patched Firefox, which it would download; Firefox itself (129 and
later) speaks WebDriver BiDi on ``--remote-debugging-port`` with no driver in between. This client
starts a headless Firefox on a fresh profile, opens a session, navigates the first tab, evaluates
scripts in it and collects every console and JavaScript error it logs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.sync.client import ClientConnection, connect

__all__ = ["Firefox", "firefox_executable"]


def firefox_executable() -> Path | None:
    """``$JOURNEYMAN_FIREFOX``, else Debian's ``firefox-esr`` or a ``firefox`` on the PATH."""
    named = os.environ.get("JOURNEYMAN_FIREFOX")
    found = named or shutil.which("firefox-esr") or shutil.which("firefox")
    return Path(found) if found else None


class Firefox:
    """A headless Firefox with one tab: ``goto``, ``evaluate``, ``screenshot``, and ``errors``."""

    def __init__(self, executable: Path, width: int = 1400, height: int = 900) -> None:
        self.executable = executable
        self.size = (width, height)
        self.errors: list[str] = []
        self._profile = tempfile.TemporaryDirectory(prefix="journeyman-firefox-")
        self._process: subprocess.Popen[str] | None = None
        self._socket: ClientConnection | None = None
        self._closing = ExitStack()
        self._next_id = 0
        self.context = ""

    def __enter__(self) -> Firefox:
        self._process = subprocess.Popen(
            [str(self.executable), "--headless", "--no-remote", "--profile", self._profile.name,
             "--remote-debugging-port", "0", f"--width={self.size[0]}", f"--height={self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._closing.callback(self._stop)
        try:
            url = f"{self._bidi_url()}/session"
            self._socket = self._closing.enter_context(connect(url, max_size=2**26, open_timeout=30))
            self.send("session.new", {"capabilities": {"alwaysMatch": {"acceptInsecureCerts": True}}})
            self.send("session.subscribe", {"events": ["log.entryAdded"]})
            self.context = self.send("browsingContext.getTree", {})["contexts"][0]["context"]
        except BaseException:
            self._closing.close()  # no browser left behind
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        with self._closing:  # the socket, then the browser and its profile
            self.send("session.end", {})

    def _stop(self) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait(timeout=30)
        self._profile.cleanup()

    def _bidi_url(self) -> str:
        """Firefox prints ``WebDriver BiDi listening on ws://...`` on stderr once it listens."""
        assert self._process is not None and self._process.stderr is not None
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = self._process.stderr.readline()
            lines.append(line)
            if match := re.search(r"WebDriver BiDi listening on (ws://\S+)", line):
                return match.group(1).rstrip("/")
            if not line and self._process.poll() is not None:
                break
        raise RuntimeError(f"Firefox did not open its WebDriver BiDi port: {''.join(lines)[-2000:]}")

    def send(self, method: str, params: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        """One command; events that arrive before its answer are recorded (errors) on the way."""
        assert self._socket is not None
        self._next_id += 1
        self._socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self._socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("type") == "event":
                self._event(message)
            elif message.get("id") == self._next_id:
                if message.get("type") == "error":
                    raise RuntimeError(f"{method}: {message.get('error')}: {message.get('message')}")
                result: dict[str, Any] = message["result"]
                return result

    def _event(self, message: dict[str, Any]) -> None:
        entry = message.get("params", {})
        if message.get("method") == "log.entryAdded" and entry.get("level") == "error":
            self.errors.append(f"{entry.get('type')}: {entry.get('text')}")

    def goto(self, url: str) -> None:
        self.send("browsingContext.navigate", {"context": self.context, "url": url, "wait": "complete"})

    def evaluate(self, expression: str) -> Any:
        """The value of ``expression`` in the page (a JSON round trip; a promise is awaited)."""
        result = self.send(
            "script.evaluate",
            {"expression": f"JSON.stringify({expression})", "target": {"context": self.context},
             "awaitPromise": True},
        )  # fmt: skip
        if result["type"] != "success":
            raise RuntimeError(f"{expression}: {result.get('exceptionDetails', {}).get('text')}")
        value = result["result"]
        return None if value["type"] == "undefined" else json.loads(value["value"])

    def wait_for(self, expression: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} stayed false for {timeout} s")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        result = self.send(
            "browsingContext.captureScreenshot", {"context": self.context, "origin": "document"}
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))
