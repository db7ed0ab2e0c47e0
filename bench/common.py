"""Shared by the benchmark scripts: start the real stack, summarise timings, print tables."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from journeyman.backend.models import prepare_model
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Stack:
    server: VLLMServer
    router: Router
    gateway: GatewayThread
    model_dir: Path
    workdir: Path


@contextlib.contextmanager
def serving_stack(
    served_name: str = "base", *, model: str = "smollm2-135m", **config: object
) -> Iterator[Stack]:
    """vLLM with an embedded model, a router and a gateway, stopped on exit."""
    model_dir = prepare_model(model)
    with tempfile.TemporaryDirectory(prefix="journeyman-bench-") as tmp:
        workdir = Path(tmp)
        server = VLLMServer(
            VLLMConfig(model=model_dir, served_name=served_name, **config), log_path=workdir / "vllm.log"
        )  # type: ignore[arg-type]
        server.start(timeout=600)
        try:
            router = Router(server)
            records = RecordLog(workdir / "records.jsonl")
            with GatewayThread(Gateway(router, records)) as gateway:
                yield Stack(server, router, gateway, model_dir, workdir)
            records.close()
        finally:
            server.stop()


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float], scale: float = 1000.0) -> tuple[str, str, str]:
    """Median, p95 and mean, scaled (default: seconds -> ms), as strings."""
    return (
        f"{statistics.median(values) * scale:.2f}",
        f"{percentile(values, 95) * scale:.2f}",
        f"{statistics.fmean(values) * scale:.2f}",
    )


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    """The machine a table was measured on, with the CPU model and whether it computes in bf16:
    the same 2-core label has meant hosts whose bf16 matmuls differ 1000-fold."""
    from journeyman.backend.serving.vllm import cpu_has_bf16

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    bf16 = "bf16 instructions" if cpu_has_bf16() else "no bf16 instructions"
    return f"{cpu} ({platform.machine()}, {bf16}), {os.cpu_count()} cores, Python {platform.python_version()}"
