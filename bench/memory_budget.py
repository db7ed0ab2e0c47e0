"""What a command's processes hold in memory while it runs: the policy's vLLM server, a judge's, the
trainer, measured together (not a test: numbers for bench/results.md).

    python -m bench.memory_budget --out /tmp/mem -- journeyman demo --model qwen2.5-coder-0.5b --judge ruler

Every ``--every`` seconds it reads, for each process under the command, its proportional set size
(PSS: pages shared between processes, such as a vLLM server's and its worker's, counted once
across them) from ``/proc/<pid>/smaps_rollup``, sums it by role, and reads the machine's used
memory (MemTotal - MemAvailable). It writes ``memory.csv`` (one row a sample) and
``memory.png``, and prints each role's peak and the peak of the whole. The command's own output
goes on as usual; SIGINT or SIGTERM is passed on to it, and what was sampled is still written.
"""

from __future__ import annotations

import argparse
import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:  # the process ended between listing and reading
        return ""


def _children(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _read(f"/proc/{entry.name}/stat")
            if stat:
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def _pss(pid: int) -> int:
    for line in _read(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def role(pid: int, servers: dict[int, str]) -> str:
    """What a process is: a vLLM server (by its served model name, with its engine and workers),
    or the command itself (the demo: agents, gateway and trainer in one process)."""
    command = _read(f"/proc/{pid}/cmdline").split("\0")
    if "vllm.entrypoints.openai.api_server" in command:
        name = command[command.index("--served-model-name") + 1] if "--served-model-name" in command else "?"
        servers[pid] = f"vLLM {name}"
    stat = _read(f"/proc/{pid}/stat")
    ppid = int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0
    while pid not in servers and ppid > 1:  # a server's engine and workers count as the server
        pid, stat = ppid, _read(f"/proc/{ppid}/stat")
        ppid = int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0
    return servers.get(pid, "command (agents, gateway, trainer)")


def used() -> int:
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()}
    return fields["MemTotal"] - fields["MemAvailable"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for memory.csv and memory.png")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = used()
    process = subprocess.Popen(command)
    # Ctrl-C or a kill stops the command, not the sampling: the samples so far are still written.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: process.send_signal(number))
    servers: dict[int, str] = {}
    rows: list[dict[str, float]] = []
    start = time.monotonic()
    while process.poll() is None:
        by_role: dict[str, float] = {}
        for pid in _children(process.pid):
            by_role[role(pid, servers)] = by_role.get(role(pid, servers), 0.0) + _pss(pid) / GIB
        rows.append({"seconds": time.monotonic() - start, "machine used": used() / GIB, **by_role})
        time.sleep(args.every)
    names = sorted({key for row in rows for key in row} - {"seconds"})
    with (args.out / "memory.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["seconds", *names], restval=0.0)
        writer.writeheader()
        writer.writerows(rows)
    totals = [sum(v for k, v in row.items() if k not in ("seconds", "machine used")) for row in rows]
    print(f"memory peaks over {len(rows)} samples (GiB; the machine had {baseline / GIB:.1f} in use before):")
    for name in names:
        print(f"  {name}: {max(row.get(name, 0.0) for row in rows):.2f}")
    print(f"  all of the command's processes together: {max(totals, default=0.0):.2f}")
    _plot(rows, names, args.out / "memory.png")
    return process.returncode


def _plot(rows: list[dict[str, float]], names: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    minutes = [row["seconds"] / 60 for row in rows]
    parts = [n for n in names if n != "machine used"]
    axis.stackplot(minutes, *[[row.get(n, 0.0) for row in rows] for n in parts], labels=parts, alpha=0.8)
    axis.plot(minutes, [row.get("machine used", 0.0) for row in rows], color="black", label="machine used")
    axis.axhline(24, color="tab:red", linestyle="--", label="24 GiB")
    axis.set(xlabel="minutes", ylabel="GiB (PSS)", title="memory by process")
    axis.legend(loc="upper left", fontsize=7)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
