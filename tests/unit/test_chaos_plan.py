"""bench.chaos's plan: which step and phase each fault waits for; a judge fault holds the judge's
server down until a group's judging failed."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos import AT_ONCE, FIXED_PHASE, KINDS, Fault, _answers, _hold_judge_down, _server, plan


@pytest.mark.parametrize("seed", range(5))
def test_faults_take_steps_of_their_own_while_there_are_steps_enough(seed: int) -> None:
    faults = plan(10, 26, list(KINDS), seed=seed, max_delay=8.0)
    assert [f.kind for f in faults] == [*KINDS, *KINDS]  # kinds in turn
    steps = [f.step for f in faults]
    assert [f.planned_step for f in faults] == steps  # kept when a fault slips to a later step
    assert steps == sorted(steps) and len(set(steps)) == 10 and all(0 <= s < 26 for s in steps)
    for fault in faults:
        assert fault.phase == FIXED_PHASE.get(fault.kind, fault.phase)
        # A train or deploy phase can last a tenth of a second: those faults go in at once, and
        # the judge's server dies as the rollouts begin (judged later, a fast step's groups were
        # judged before it died).
        if fault.phase == "rollouts" and fault.kind not in AT_ONCE:
            assert 0 <= fault.delay <= 8.0
        else:
            assert fault.delay == 0.0


def test_more_faults_than_steps_share_steps() -> None:
    faults = plan(5, 2, ["vllm"], seed=0, max_delay=1.0)
    assert len(faults) == 5 and {f.step for f in faults} <= {0, 1}


def test_the_same_seed_plans_the_same_run() -> None:
    assert plan(5, 5, list(KINDS), seed=3, max_delay=4.0) == plan(5, 5, list(KINDS), seed=3, max_delay=4.0)


SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[-1])), Health).serve_forever()
"""


def _demo_with_a_judge(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A stand-in demo process whose child answers /health like a judge's vLLM server (the
    harness finds it by its command line)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    server = [sys.executable, str(script), "vllm.entrypoints.openai.api_server", "--served-model-name",
              "judge", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    demo = subprocess.Popen(["sh", "-c", f"{shlex.join(server)} & wait"])
    deadline = time.monotonic() + 30
    while (pid := _server(demo.pid, judge=True)) is None or not _answers(pid):
        assert time.monotonic() < deadline, "the stand-in judge server never answered"
        time.sleep(0.05)
    return demo, pid


def test_a_judge_back_before_its_groups_failed_is_killed_again(tmp_path: Path) -> None:
    demo, pid = _demo_with_a_judge(tmp_path)
    try:
        log = tmp_path / "demo.log"
        log.write_bytes(b"the judge's vLLM server died: judging 2 group(s) again once it is back\n")
        fault = Fault("judge", 3, "rollouts", 0.0)
        # The line was there before the fault went in: it says nothing of this step.
        assert _hold_judge_down(fault, demo, log, since=log.stat().st_size)
        assert fault.killed_again == 1 and _server(demo.pid, judge=True) is None  # reaped by sh
        with log.open("ab") as out:  # the demo's console wraps lines where it likes
            out.write(b"[yellow]the judge's vLLM server died: judging 1\ngroup(s) again once it is back\n")
        assert not _hold_judge_down(fault, demo, log, since=0)
        assert fault.killed_again == 1
    finally:
        demo.kill()
        demo.wait()
    assert not _answers(pid)
