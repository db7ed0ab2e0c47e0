"""The viewer on a big store: how long the run page and a step page take, and the process's memory.

A synthetic store of ``--steps`` x ``--groups`` x ``--size`` trajectories (default 200 x 32 x 8 =
51,200), each a system prompt, a question and ``--turns`` token-exact model turns with tool calls
and results, plus a history row per step, an evaluation every 10 steps and a checkpoint per step.
``journeyman ui`` serves it in a process of its own; each page is asked for ``--requests`` times
over HTTP: the run page, a step page of a different step each time (each file read and parsed
cold), the same step page again (warm), and an attempt page. Memory is the process's peak
resident set (VmHWM) after all of it.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import journeyman as jm
from bench.common import machine, summary, table
from journeyman.backend.serving.vllm_config import free_port
from journeyman.messages import ModelTurn
from journeyman.store import ModelStore


def attempt(rng: random.Random, turns: int, tokens: int) -> jm.Trajectory:
    conversation: list[object] = [
        {"role": "system", "content": "You answer questions about the user's inbox. " * 8},
        {"role": "user", "content": "What is the confirmation code of my flight to Denver?"},
    ]
    prompt = [rng.randrange(50_000) for _ in range(tokens * 2)]
    for n in range(turns):
        completion = [rng.randrange(50_000) for _ in range(tokens)]
        call = {
            "id": f"c{n}",
            "type": "function",
            "function": {"name": "search_emails", "arguments": '{"q": "x"}'},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        conversation.append(
            ModelTurn.model_validate(
                {
                    "message": message, "model": "bench@1", "prompt_token_ids": prompt,
                    "completion_token_ids": completion, "logprobs": [-rng.random() for _ in completion],
                }
            )
        )  # fmt: skip
        result = "id 17 | 2025-03-02 | travel@air.example | Your flight to Denver " * 4
        conversation.append({"role": "tool", "tool_call_id": f"c{n}", "content": result})
        prompt = [*prompt, *completion, *(rng.randrange(50_000) for _ in range(tokens))]
    return jm.Trajectory(
        conversation=conversation, reward=rng.random(), metrics={"success": rng.random() < 0.3}
    )


def build(root: Path, steps: int, groups: int, size: int, turns: int, tokens: int) -> ModelStore:
    store = ModelStore("bench", "viewer", root=root)
    if store.history_path.exists():
        return store
    rng = random.Random(0)
    template = [attempt(rng, turns, tokens) for _ in range(size * 4)]
    started = time.monotonic()
    for step in range(steps):
        batch = []
        for _ in range(groups):
            picked = rng.sample(template, size)
            batch.append(
                jm.TrajectoryGroup([t.model_copy(update={"id": jm.Trajectory().id}) for t in picked])
            )
        store.save_groups(batch, "train", step)
        store.append_history(
            {"step": step + 1, "split": "train", "reward/mean": rng.random(), "reward/std": rng.random(),
             "train/loss": rng.random(), "mismatch/kl": rng.random() / 100, "train/entropy": rng.random(),
             "data/zero_variance_share": rng.random(), "time/forward_backward": 30 * rng.random()}
        )  # fmt: skip
        if step % 10 == 0:
            store.append_history({"step": step, "split": "val", "val/reward": rng.random()})
        with store.write_checkpoint(step + 1) as folder:
            (folder / "trainer_state.json").write_text(json.dumps({"step": step + 1, "metrics": {}}))
            (folder / "adapter.safetensors").write_bytes(b"\0" * 4096)
        if step % 20 == 0:
            print(
                f"store: step {step}/{steps} ({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return store


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=60, help="completion tokens per model turn")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--store", type=Path, help="build (or reuse) the store here instead of a temporary folder"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="journeyman-viewer-") as tmp:
        root = args.store or Path(tmp)
        store = build(root, args.steps, args.groups, args.size, args.turns, args.tokens)
        size_mb = sum(p.stat().st_size for p in (store.path / "trajectories").rglob("*.jsonl")) / 2**20
        port = free_port("127.0.0.1")
        server = subprocess.Popen(
            [sys.executable, "-m", "journeyman.backend", "ui", "--root", str(root), "--port", str(port)],
            stdout=subprocess.DEVNULL,
        )
        try:
            rows = measure(f"http://127.0.0.1:{port}", store, args)
            peak = next(
                line.split()[1] for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
                if line.startswith("VmHWM")
            )  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"### Viewer on a big store (`python -m bench.viewer`)\n\n{machine()}\n")
    print(
        f"{args.steps} steps x {args.groups} groups x {args.size} attempts ({args.steps * args.groups * args.size:,}"
        f" trajectories, {args.turns} token-exact model turns each; {size_mb:.0f} MB of trajectory files); "
        f"{args.requests} requests a page, one at a time, from another process.\n"
    )
    print(table(["page", "p50 ms", "p95 ms", "mean ms"], rows))
    print(f"\nPeak memory of the viewer process (VmHWM): {int(peak) / 1024:.0f} MB.")


def measure(url: str, store: ModelStore, args: argparse.Namespace) -> list[list[str]]:
    with httpx.Client(base_url=url, timeout=120) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.get("/").raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        group = store.load_groups("train", 7)[3]
        pages = {
            "runs": ["/"] * args.requests,
            "a run (curves, checkpoints, steps)": ["/runs/bench/viewer"] * args.requests,
            "a step, each a different one (cold)": [
                f"/runs/bench/viewer/train/{(10 + n) % args.steps}" for n in range(args.requests)
            ],
            "the same step again (warm)": ["/runs/bench/viewer/train/7"] * args.requests,
            "an attempt (conversation, tokens)": [f"/runs/bench/viewer/train/7/3/{group.trajectories[0].id}"]
            * args.requests,
        }
        rows = []
        for name, paths in pages.items():
            times = []
            for path in paths:
                start = time.perf_counter()
                client.get(path).raise_for_status()
                times.append(time.perf_counter() - start)
            rows.append([name, *summary(times)])
        return rows


if __name__ == "__main__":
    main()
