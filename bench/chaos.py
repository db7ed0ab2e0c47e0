"""A chaos run of a training loop (the demo's, or any script's ``jm.TrainingLoop``): faults
injected at moments drawn from a seed, the run carried on through each, its promises checked from
its files at the end.

The run (``python -m bench.chaos`` runs ``journeyman demo``; :func:`run` takes any command)
runs in a process group of its own. Each fault of the plan waits
for its step, then for its phase of that step, read from the run's files (``rollouts``: a drawn
delay after the step before it completed; ``train``: the step's groups are stored and its
checkpoint is not written yet, so the optimizer step or the checkpoint write is running;
``deploy``: the checkpoint is written and its history row is not, so the merged reload is
running), and is injected:

- ``vllm``: the policy's vLLM server is killed -9 (LocalBackend's watchdog restarts it; rollouts
  that failed meanwhile are recorded on their groups, or the demo stops and is resumed);
- ``judge``: the judge's vLLM server is killed -9 as the step's rollouts begin (needs ``--judge
  ruler --judge-model ...``), and killed again each time it answers before the demo said a
  group's judging failed or the step ended, so its groups ask while it is dead or restarting and
  are judged again once it is back. (Killed once, a restart that took less than the step's
  rollouts, slowed by that restart on the same cores, left the groups nothing to fail; drawn
  later into the rollouts, a fast machine's groups were judged before the kill);
- ``kill``: the demo process is killed -9, and the gateway, the trainer and the rollouts with it;
- ``interrupt``: Ctrl-C (SIGINT to the demo's process group);
- ``memory``: the demo process's address space is capped (``RLIMIT_AS``) just above what it
  uses, so the training step's next allocations fail; lifted once the step ended either way.

Whenever the demo exits other than 0 the harness runs ``journeyman demo --resume``, until it
finishes; a demo that completes no step for ``--stall`` seconds is killed and resumed, and counted
as a stall. At the end ``journeyman check --on-policy`` must find every promise kept. Prints a
table per fault (kind, phase, step, seconds from the fault to the next completed step, next to a
step's usual seconds) and the held-out success of the report, and writes the faults beside the
run's folder (``<name>.chaos.json``, its steps counted from 1, for ``python -m bench.chaos_pair``).

    python -m bench.chaos --faults 10 --seed 0 --steps 24        # the long run (bench/results.md)
    python -m bench.chaos --steps 4 --faults 4                   # like tests/faults' short one
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("vllm", "kill", "interrupt", "memory", "judge")
PHASES = ("rollouts", "train", "deploy")
FIXED_PHASE = {"memory": "train", "interrupt": "rollouts", "judge": "rollouts"}
"""Kinds with one phase: the cap must meet the training step; Ctrl-C and the judge's server
matter while groups are sampled and judged."""
AT_ONCE = {"judge"}
"""Kinds injected as their phase begins, whatever delay was drawn."""
BEFORE = "demo_before.json"
"""Written once the held-out evaluation before training is done: the steps begin."""
JUDGED_AGAIN = re.compile(rb"judging\s+\d+\s+group\(s\)\s+again")
"""What the demo prints once a step's groups failed their judging on a dead judge server."""
LOOP_SPLITS = ("train", "rollouts")
"""The history's rows of training steps; any other split is an evaluation."""
MEMORY_MARGIN = 64 * 2**20
"""Address space left above what the demo uses when the cap is set."""


@dataclass
class Fault:
    kind: str
    step: int
    """Inject once this many steps have completed..."""
    phase: str
    """...in this phase of the next step (its first chance when missed)..."""
    delay: float
    """...this many seconds into it (``rollouts``; the others at once: a step whose groups have no
    reward spread trains nothing, and its ``train`` phase is only the checkpoint write). A fault
    whose phase ended before its delay is injected at once at its next chance."""
    planned_step: int = field(init=False)
    """The step the plan drew (``step`` becomes the step it went in at)."""
    injected_at: float | None = None
    recovered_after: float | None = None
    """Seconds from the fault to the next completed step (None: the run ended first)."""
    outcome: str = ""
    """What followed: the demo carried on, exited (and was resumed), or the run ended first."""
    killed_again: int = 0
    """``judge``: how often its server was killed again, back before a group's judging failed."""

    def __post_init__(self) -> None:
        self.planned_step = self.step


@dataclass
class ChaosRun:
    run_dir: Path
    faults: list[Fault]
    restarts: int = 0
    stalls: int = 0
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    """Seconds of each step that met no fault."""
    report: dict[str, Any] = field(default_factory=dict)
    check_output: str = ""
    check_ok: bool = False


def plan(faults: int, steps: int, kinds: list[str], seed: int, max_delay: float) -> list[Fault]:
    """``faults`` faults, kinds in turn, at steps drawn from the seed in 0..steps-1 (in order),
    each at a step of its own while there are steps enough (faults at one step wait for each other)."""
    rng = random.Random(seed)
    if faults <= steps:
        at = sorted(rng.sample(range(steps), faults))
    else:
        at = sorted(rng.randrange(steps) for _ in range(faults))
    planned = []
    for i, step in enumerate(at):
        kind = kinds[i % len(kinds)]
        phase = FIXED_PHASE.get(kind) or rng.choice(PHASES)
        delay = rng.uniform(0, max_delay) if phase == "rollouts" else 0.0
        if kind in AT_ONCE:
            delay = 0.0
        planned.append(Fault(kind, step, phase, delay))
    return planned


@dataclass
class Progress:
    """What the run's files say about where it is."""

    trained: int
    """Completed steps (their ``train`` history rows)."""
    phase: str

    @classmethod
    def read(cls, run_dir: Path) -> Progress:
        rows = _history(run_dir)
        trained = len({r["step"] for r in rows if r.get("split") == "train"})
        if (run_dir / "checkpoints" / f"{trained + 1:04d}").is_dir():
            return cls(trained, "deploy")
        if (run_dir / "trajectories" / "train" / f"{trained:04d}.jsonl").exists():
            return cls(trained, "train")
        return cls(trained, "rollouts")


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


def _server(pid: int, judge: bool) -> int | None:
    """The policy's vLLM server under ``pid`` (served as ``base``), or the judge's (any other name)."""
    for child in _children(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" not in b" ".join(args) or b"--served-model-name" not in args:
            continue
        name = args[args.index(b"--served-model-name") + 1]
        if (name == b"base") != judge:
            return child
    return None


def _answers(pid: int) -> bool:
    """Whether the vLLM server ``pid`` answers ``/health`` (it is up, not starting)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        host, port = (args[args.index(flag) + 1].decode() for flag in (b"--host", b"--port"))
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=0.5) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def _hold_judge_down(fault: Fault, demo: subprocess.Popen[bytes], log: Path, since: int) -> bool:
    """Kill the judge's server again if it answers before the demo said (in ``log`` after byte
    ``since``) that a group's judging failed; False once it said so."""
    with log.open("rb") as out:
        out.seek(since)
        if JUDGED_AGAIN.search(out.read()):
            return False
    pid = _server(demo.pid, judge=True)
    if pid is not None and _answers(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            fault.killed_again += 1
    return True


def demo_command(args: list[str]) -> list[str]:
    """``journeyman demo`` with ``args``, as a command for :func:`run`."""
    return [sys.executable, "-m", "journeyman.backend", "demo", *args]


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def _history(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    path = run_dir / "history.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                rows.append(json.loads(line))
    return rows


def _steps_began(run_dir: Path) -> bool:
    """Whether the run evaluated before training (the demo's file, or any training loop's held-out
    row): its steps' rollouts are what is sampled now."""
    return (run_dir / BEFORE).exists() or any(r.get("split") not in LOOP_SPLITS for r in _history(run_dir))


def _report(run_dir: Path) -> dict[str, Any]:
    """The demo's report, or for another training loop its first and last evaluation of ``val``
    from the history, shaped alike (``{"before": {"step", "sampled"}, "after": ...}``)."""
    path = run_dir / "demo_report.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    rows = sorted((r for r in _history(run_dir) if r.get("split") == "val"), key=lambda r: int(r["step"]))
    if not rows:
        return {}

    def evaluation(row: dict[str, Any]) -> dict[str, Any]:
        values = {k.removeprefix("val/"): v for k, v in row.items() if k.startswith("val/")}
        return {"step": int(row["step"]), "sampled": values}

    return {"before": evaluation(rows[0]), "after": evaluation(rows[-1])}


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    with contextlib.suppress(ProcessLookupError):  # what the group left (vLLM servers, in sessions
        os.killpg(process.pid, signal.SIGKILL)  # of their own, end on the SIGTERM a dead parent sends)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _address_space(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmSize for process {pid}")


def _inject(fault: Fault, demo: subprocess.Popen[bytes]) -> bool:
    """Inject ``fault`` into the running demo; False when its target is not there yet."""
    if fault.kind in ("vllm", "judge"):
        pid = _server(demo.pid, judge=fault.kind == "judge")
        if pid is None:  # starting, restarting, or no judge server: tried again shortly
            return False
        os.kill(pid, signal.SIGKILL)
    elif fault.kind == "kill":
        os.killpg(demo.pid, signal.SIGKILL)
    elif fault.kind == "interrupt":
        os.killpg(demo.pid, signal.SIGINT)
    elif fault.kind == "memory":
        cap = _address_space(demo.pid) + MEMORY_MARGIN
        resource.prlimit(demo.pid, resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}: {', '.join(KINDS)}")
    return True


def _lift(demo: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        resource.prlimit(demo.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run(
    command: list[str],
    run_dir: Path,
    faults: list[Fault],
    timeout: float,
    stall: float = 900.0,
    steps: int | None = None,
    resume: list[str] | None = None,
) -> ChaosRun:
    """``command`` (the demo, :func:`demo_command`, or a script that trains with ``jm.TrainingLoop``
    into ``run_dir``) with ``faults`` injected, resumed with ``resume`` until it finishes (None:
    ``command`` again, which is how a training loop resumes); then ``journeyman check``. A fault
    that slipped past the last of ``steps`` (its step's phase was over before its delay) is not
    injected into the evaluation after training: "the run ended first"."""
    chaos = ChaosRun(run_dir, faults)
    log = run_dir.parent / f"{run_dir.name}.chaos.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    records = run_dir.parents[1] / "gateway" / "completions.jsonl"
    sampled_before = _size(records)
    demo = _start(command, log)
    pending = list(faults)
    seen, step_time, phase_time, phase = 0, time.monotonic(), time.monotonic(), "rollouts"
    capped: Fault | None = None
    ending = False  # a kill or Ctrl-C was sent: the next fault waits for the process that resumes
    open_faults: list[Fault] = []
    waiting: Fault | None = None  # due but for its delay when last looked
    held: tuple[Fault, int] | None = None  # a judge fault, and the log's size when it went in
    try:
        while True:
            assert time.monotonic() - started < timeout, f"the chaos run passed {timeout:.0f} s (log: {log})"
            now, progress = time.monotonic(), Progress.read(run_dir)
            if progress.trained > seen:
                if not open_faults and seen > 0:
                    chaos.step_seconds.append(now - step_time)
                for fault in open_faults:
                    fault.recovered_after = now - (fault.injected_at or now)
                    fault.outcome = fault.outcome or "carried on"
                open_faults.clear()
                seen, step_time, held = progress.trained, now, None
                if capped is not None:  # the step ended with the cap on: lift it
                    _lift(demo)
                    capped = None
            if progress.phase != phase:
                if waiting is not None and waiting.phase == phase:  # its phase ended before its delay:
                    waiting.delay = 0.0  # the next chance comes at once (a fast machine's steps are short)
                phase, phase_time = progress.phase, now
            code = demo.poll()
            if code == 0:
                break
            stalled = code is None and now - step_time > stall
            if code is not None or stalled:  # died, by a fault or of one (or hung): go on with the run
                chaos.stalls += stalled
                for fault in open_faults:
                    fault.outcome = fault.outcome or f"demo exited {code}, resumed"
                _stop_group(demo)
                capped, ending, held = None, False, None
                chaos.restarts += 1
                sampled_before = _size(records)
                demo = _start(resume or command, log)
                step_time = phase_time = time.monotonic()  # delays count from the restart
                phase, waiting = "rollouts", None
                continue
            if held is not None and not _hold_judge_down(held[0], demo, log, held[1]):
                held = None
            upcoming = pending[0] if pending else None
            ready = (
                upcoming is not None
                and capped is None
                and not ending
                and not open_faults  # one fault at a time: each one's outcome and time are its own
                and progress.trained >= upcoming.step
                and (steps is None or progress.trained < steps)
                and progress.phase == upcoming.phase
                # rollouts: once this process samples the steps (not while vLLM starts or evaluates first)
                and (
                    upcoming.phase != "rollouts"
                    or (_size(records) > sampled_before and _steps_began(run_dir))
                )
            )
            waiting = upcoming if ready else None
            due = ready and upcoming is not None and now - phase_time >= upcoming.delay
            if upcoming is not None and due and _inject(upcoming, demo):
                pending.pop(0)
                upcoming.injected_at, upcoming.step = time.monotonic(), progress.trained
                open_faults.append(upcoming)
                capped = upcoming if upcoming.kind == "memory" else None
                held = (upcoming, _size(log)) if upcoming.kind == "judge" else None
                ending = upcoming.kind in ("kill", "interrupt")
            # A train or deploy phase can be a tenth of a second long: look often once one is due.
            near = upcoming is not None and upcoming.phase != "rollouts" and progress.trained >= upcoming.step
            time.sleep(0.01 if near else 0.1)
    finally:
        _stop_group(demo)
    for fault in pending:
        fault.outcome = "the run ended first"
    for fault in open_faults:
        fault.outcome = fault.outcome or "the run ended first"
    chaos.seconds = time.monotonic() - started
    chaos.report = _report(run_dir)
    check = subprocess.run(
        [sys.executable, "-m", "journeyman.backend", "check", "--on-policy", str(run_dir)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    chaos.check_output, chaos.check_ok = check.stdout + check.stderr, check.returncode == 0
    write_faults(faults, run_dir.parent / f"{run_dir.name}.chaos.json")  # for python -m bench.chaos_pair
    return chaos


def write_faults(faults: list[Fault], path: Path) -> None:
    """The faults as JSON, their steps counted from 1 (as the table and the demo's lines count)."""
    rows = [{**asdict(f), "step": f.step + 1, "planned_step": f.planned_step + 1} for f in faults]
    path.write_text(json.dumps(rows, indent=1))


def table(chaos: ChaosRun) -> str:
    usual = statistics.median(chaos.step_seconds) if chaos.step_seconds else float("nan")
    lines = [
        "| fault | phase | during step | then | s to the next step done | s lost (a step is usually "
        f"{usual:.0f} s) |",
        "|---|---|---|---|---|---|",
    ]
    for fault in chaos.faults:
        done = fault.recovered_after
        recovered = f"{done:.0f}" if done is not None else "-"
        lost = f"{max(done - usual, 0):.0f}" if done is not None and usual == usual else "-"
        slipped = f" (planned {fault.planned_step + 1})" if fault.step != fault.planned_step else ""
        again = f" (killed again {fault.killed_again}x)" if fault.killed_again else ""
        lines.append(
            f"| {fault.kind}{again} | {fault.phase} | {fault.step + 1}{slipped} | {fault.outcome} | {recovered} "
            f"| {lost} |"
        )
    lines += ["", "| fault kind | injected | resumes it took | s lost, mean |", "|---|---|---|---|"]
    for kind in dict.fromkeys(f.kind for f in chaos.faults):
        of_kind = [f for f in chaos.faults if f.kind == kind and f.injected_at is not None]
        lost = [max(f.recovered_after - usual, 0) for f in of_kind if f.recovered_after is not None]
        resumed = sum("resumed" in f.outcome for f in of_kind)
        mean = f"{statistics.mean(lost):.0f}" if lost and usual == usual else "-"
        lines.append(f"| {kind} | {len(of_kind)} | {resumed} | {mean} |")
    after = chaos.report.get("after", {}).get("sampled", {})
    before = chaos.report.get("before", {}).get("sampled", {})
    lines.append("")
    lines.append(
        f"{sum(f.injected_at is not None for f in chaos.faults)} faults injected, {chaos.restarts} resumes "
        f"({chaos.stalls} after a stall), {chaos.seconds / 60:.1f} min; held-out success "
        f"{before.get('success', float('nan')):.2f} -> {after.get('success', float('nan')):.2f}; "
        f"journeyman check --on-policy: {'every promise holds' if chaos.check_ok else 'FAILED'}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--plan", default="vllm,kill,interrupt,memory", help=f"fault kinds in turn ({KINDS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--max-delay", type=float, default=4.0, help="latest moment into a step's rollouts, s"
    )
    parser.add_argument("--root", type=Path, default=Path(".journeyman-chaos"))
    parser.add_argument("--name", default="chaos")
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    parser.add_argument("--stall", type=float, default=900.0, help="seconds without a step before a resume")
    parser.add_argument("demo_args", nargs="*", help="more `journeyman demo` flags (after --)")
    args = parser.parse_args()
    demo_args = ["--steps", str(args.steps), "--name", args.name, "--root", str(args.root),
                 "--seed", str(args.seed), "--max-train-minutes", "600", *args.demo_args]  # fmt: skip
    faults = plan(args.faults, args.steps, args.plan.split(","), args.seed, args.max_delay)
    run_dir = args.root / "demo" / args.name
    chaos = run(
        demo_command(demo_args), run_dir, faults, args.timeout, args.stall, args.steps,
        resume=demo_command(["--resume", str(run_dir)]),
    )  # fmt: skip
    print(table(chaos))
    if not chaos.check_ok:
        print(chaos.check_output)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
