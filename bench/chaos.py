"""A chaos run of the demo: faults injected at random moments drawn from a seed, the run carried
on through each, its promises checked from its files at the end.

The demo runs as ``journeyman demo`` in a process group of its own. At moments drawn from the seed
(a random delay into a random step) the harness injects one fault of a kind from the plan:

- ``vllm``: the policy's vLLM server is killed -9 (LocalBackend's watchdog restarts it; rollouts
  that failed meanwhile are recorded on their groups, or the demo stops and is resumed);
- ``kill``: the demo process is killed -9: the gateway, the trainer and the rollouts with it,
  at whatever it was doing (rollouts, the optimizer step, the checkpoint write, the merged
  reload); the harness runs ``journeyman demo --resume``;
- ``interrupt``: Ctrl-C (SIGINT to the whole group, vLLM included), then ``--resume``.

Whenever the demo exits other than 0 the harness resumes it, until it finishes. At the end
``journeyman check`` must find every promise kept. Prints a table per fault (kind, step, when,
seconds until the next step completed) and the held-out success of the report.

    python -m bench.chaos --faults 10 --seed 0                       # a long run
    python -m bench.chaos --steps 4 --faults 3 --plan vllm,kill,interrupt   # tests/faults' short one
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("vllm", "kill", "interrupt")


@dataclass
class Fault:
    kind: str
    step: int
    """Inject once this many steps have completed..."""
    delay: float
    """...and this many seconds have passed after that."""
    injected_at: float | None = None
    recovered_after: float | None = None
    """Seconds from the fault to the next completed step (None: the run ended first)."""
    missed: str | None = None


@dataclass
class ChaosRun:
    run_dir: Path
    faults: list[Fault]
    restarts: int = 0
    seconds: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    check_output: str = ""
    check_ok: bool = False


def plan(faults: int, steps: int, kinds: list[str], seed: int, max_delay: float) -> list[Fault]:
    """``faults`` faults, kinds in turn, at steps drawn from the seed (in order, in 0..steps-1)."""
    rng = random.Random(seed)
    at = sorted(rng.randrange(steps) for _ in range(faults))
    return [Fault(kinds[i % len(kinds)], step, rng.uniform(0, max_delay)) for i, step in enumerate(at)]


def _trained(run_dir: Path) -> int:
    """Completed steps, from the history file (the harness reads files only)."""
    path = run_dir / "history.jsonl"
    if not path.exists():
        return 0
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return len({r["step"] for r in rows if r.get("split") == "train"})


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _vllm(pid: int) -> int | None:
    for child in _children(pid):
        try:
            if b"vllm.entrypoints" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "journeyman.backend", "demo", *args],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    with contextlib.suppress(ProcessLookupError):  # what the group left (vLLM outlives a killed demo)
        os.killpg(process.pid, signal.SIGKILL)


def run(demo_args: list[str], run_dir: Path, faults: list[Fault], timeout: float) -> ChaosRun:
    """The demo with ``faults`` injected, resumed until it finishes; then ``journeyman check``."""
    chaos = ChaosRun(run_dir, faults)
    log = run_dir.parent / f"{run_dir.name}.chaos.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    demo = _start(demo_args, log)
    pending = list(faults)
    step_seen, step_time = 0, time.monotonic()
    try:
        while True:
            assert time.monotonic() - started < timeout, f"the chaos run passed {timeout:.0f} s (log: {log})"
            trained = _trained(run_dir)
            now = time.monotonic()
            if trained > step_seen:
                step_seen, step_time = trained, now
                for fault in faults:
                    if fault.injected_at is not None and fault.recovered_after is None:
                        fault.recovered_after = now - fault.injected_at
            code = demo.poll()
            if code == 0:
                break
            if code is not None:  # died, by a fault or of one: go on with the run
                _stop_group(demo)
                chaos.restarts += 1
                demo = _start(["--resume", str(run_dir)], log)
                step_time = time.monotonic()  # the next fault's delay counts from the restart
                continue
            due = pending and trained >= pending[0].step and now - step_time >= pending[0].delay
            if due and _inject(pending[0], demo):  # else (no vLLM up yet) it is tried again shortly
                fault = pending.pop(0)
                fault.injected_at, fault.step, fault.missed = time.monotonic(), trained, None
            time.sleep(0.2)
    finally:
        _stop_group(demo)
    for fault in pending:
        fault.missed = "the run ended first"
    chaos.seconds = time.monotonic() - started
    report = run_dir / "demo_report.json"
    chaos.report = json.loads(report.read_text()) if report.exists() else {}
    check = subprocess.run(
        [sys.executable, "-m", "journeyman.backend", "check", str(run_dir)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    chaos.check_output, chaos.check_ok = check.stdout + check.stderr, check.returncode == 0
    return chaos


def _inject(fault: Fault, demo: subprocess.Popen[bytes]) -> bool:
    if fault.kind == "vllm":
        pid = _vllm(demo.pid)
        if pid is None:  # not started yet, or between servers: tried again at the next moment
            fault.missed = "no vLLM server was running"
            return False
        os.kill(pid, signal.SIGKILL)
    elif fault.kind == "kill":
        os.killpg(demo.pid, signal.SIGKILL)
    elif fault.kind == "interrupt":
        os.killpg(demo.pid, signal.SIGINT)
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}: {', '.join(KINDS)}")
    return True


def table(chaos: ChaosRun) -> str:
    lines = ["| fault | after step | recovered in s |", "|---|---|---|"]
    for fault in chaos.faults:
        recovered = (
            f"{fault.recovered_after:.0f}" if fault.recovered_after is not None else (fault.missed or "-")
        )
        lines.append(f"| {fault.kind} | {fault.step} | {recovered} |")
    after = chaos.report.get("after", {}).get("sampled", {})
    before = chaos.report.get("before", {}).get("sampled", {})
    lines.append("")
    lines.append(
        f"{sum(f.injected_at is not None for f in chaos.faults)} faults injected, {chaos.restarts} resumes, "
        f"{chaos.seconds / 60:.1f} min; held-out success {before.get('success', float('nan')):.2f} -> "
        f"{after.get('success', float('nan')):.2f}; journeyman check: "
        f"{'every promise holds' if chaos.check_ok else 'FAILED'}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--plan", default=",".join(KINDS), help="fault kinds, in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-delay", type=float, default=20.0, help="latest moment into a step, s")
    parser.add_argument("--root", type=Path, default=Path(".journeyman-chaos"))
    parser.add_argument("--name", default="chaos")
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    parser.add_argument("demo_args", nargs="*", help="more `journeyman demo` flags (after --)")
    args = parser.parse_args()
    demo_args = ["--steps", str(args.steps), "--name", args.name, "--root", str(args.root),
                 "--seed", str(args.seed), "--max-train-minutes", "600", *args.demo_args]  # fmt: skip
    faults = plan(args.faults, args.steps, args.plan.split(","), args.seed, args.max_delay)
    chaos = run(demo_args, args.root / "demo" / args.name, faults, args.timeout)
    print(table(chaos))
    if not chaos.check_ok:
        print(chaos.check_output)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
