"""``journeyman serve`` on a cloud GPU with SkyPilot: launch, status, tear down, and a connected
:class:`~journeyman.RemoteBackend` in one call (:meth:`SkyPilotBackend.launch`).

SkyPilot cannot share journeyman's environment (it pins click and uvicorn below what journeyman's
dependencies need), so it runs from an environment of its own (``scripts/skypilot-env.sh``, part of
``make setup``): each call here is a short program run by that environment's Python, which talks to
SkyPilot's API server (a local one SkyPilot starts when none runs) and prints one JSON line. The
recipe is ``deploy/skypilot/journeyman-serve.yaml``; the node gets the journeyman source tree this
runs from (SkyPilot's ``workdir``), as the recipe's set-up installs it. Usage collection is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import journeyman
from journeyman.errors import BackendError, ConfigError
from journeyman.remote import RemoteBackend

from ..settings import journeyman_home

__all__ = ["CloudServe", "SkyPilotBackend", "skypilot_python", "source_tree"]

PORT = 8000
MARK = "JOURNEYMAN-CLOUD "

_RUNNER = r"""
import json, os, sys

def out(**fields):
    print("JOURNEYMAN-CLOUD " + json.dumps(fields), flush=True)
    sys.exit(0)

args = json.loads(sys.argv[1])
action = args["action"]
try:
    import sky
    from sky.client import sdk

    def task():
        made = sky.Task.from_yaml(args["recipe"])
        made.update_envs(args["envs"])
        made.workdir = args["workdir"]
        if args.get("gpus"):
            made.set_resources_override({"accelerators": args["gpus"]})
        made.update_secrets({name: os.environ.get(name, "") for name in args["secrets"]})
        return made

    if action == "plan":
        made = task()
        out(envs=made.envs, workdir=made.workdir, secrets=sorted(made.secrets), name=made.name,
            accelerators=sorted({str(a) for r in made.resources for a in (r.accelerators or {})}),
            ports=sorted({str(p) for r in made.resources for p in (r.ports or [])}))
    if action == "clouds":
        out(clouds=[str(c) for c in sdk.get(sdk.enabled_clouds())])
    if action == "up":
        clouds = [str(c) for c in sdk.get(sdk.enabled_clouds())]
        if not clouds:
            out(error="no_cloud", message="no cloud is enabled")
        sdk.stream_and_get(sdk.launch(task(), cluster_name=args["cluster"],
                                      idle_minutes_to_autostop=args.get("autostop")))
        endpoints = sdk.get(sdk.endpoints(args["cluster"], args["port"]))
        out(endpoint=next(iter(endpoints.values()), None), clouds=clouds)
    if action == "status":
        records = sdk.get(sdk.status(cluster_names=[args["cluster"]]))
        if not records:
            out(status=None, endpoint=None)
        record = records[0]
        status = str(getattr(record, "status", None) or record.get("status"))
        endpoint = None
        if status.endswith("UP"):
            endpoint = next(iter(sdk.get(sdk.endpoints(args["cluster"], args["port"])).values()), None)
        out(status=status.rsplit(".", 1)[-1], endpoint=endpoint)
    if action == "down":
        sdk.get(sdk.down(args["cluster"]))
        out(down=True)
    out(error="usage", message=f"unknown action {action!r}")
except SystemExit:
    raise
except BaseException as error:
    out(error=type(error).__name__, message=str(error)[:2000])
"""


def skypilot_python() -> Path:
    """The Python of SkyPilot's environment (``$JOURNEYMAN_SKYPILOT_VENV``, default
    ``$JOURNEYMAN_HOME/venvs/skypilot``)."""
    venv = Path(os.environ.get("JOURNEYMAN_SKYPILOT_VENV") or journeyman_home() / "venvs" / "skypilot")
    python = venv.expanduser() / "bin" / "python"
    if not python.exists():
        raise ConfigError(
            f"no SkyPilot environment at {venv}: build it with `bash scripts/skypilot-env.sh` in your "
            "journeyman clone (make setup does), then add your cloud's extra there, e.g. "
            f"{venv}/bin/pip install 'skypilot[aws]==0.14.1'"
        )
    return python


def source_tree() -> Path:
    """The journeyman source tree the node installs: the clone this journeyman runs from."""
    root = Path(journeyman.__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "deploy" / "skypilot").is_dir():
        return root
    raise ConfigError(
        f"journeyman cloud sends the node a journeyman source tree, and {root} is none: install "
        "journeyman from your clone with `pip install -e`, or give --source PATH_TO_THE_CLONE"
    )


@dataclass
class CloudServe:
    """What ``journeyman cloud up`` launches: the recipe, with these settings."""

    cluster: str = "journeyman"
    base_model: str = "smollm2-135m"
    gpus: str | None = None
    """SkyPilot accelerators (``H100:1``); default: the recipe's cheapest of L4, A10G, A100, H100."""
    trainers: int = 1
    unsloth: bool = False
    report_to: list[str] = field(default_factory=list)
    autostop: int | None = None
    """Minutes idle before SkyPilot stops the cluster; None: never."""
    source: Path | None = None
    python: Path | None = None
    timeout: float = 3600.0

    @property
    def recipe(self) -> Path:
        return self.tree / "deploy" / "skypilot" / "journeyman-serve.yaml"

    @property
    def tree(self) -> Path:
        return self.source if self.source is not None else source_tree()

    def secrets(self) -> list[str]:
        """The secrets sent from this environment: the token, and W&B's key when it follows runs."""
        return ["JOURNEYMAN_TOKEN", *(["WANDB_API_KEY"] if "wandb" in self.report_to else [])]

    def arguments(self, action: str) -> dict[str, Any]:
        """What the SkyPilot program is given: the cluster, and for a launch (or its plan) the task."""
        found: dict[str, Any] = {"action": action, "cluster": self.cluster, "port": PORT}
        if action not in ("plan", "up"):
            return found
        return found | {
            "recipe": str(self.recipe),
            "workdir": str(self.tree),
            "gpus": self.gpus,
            "autostop": self.autostop,
            "secrets": self.secrets(),
            "envs": {
                "BASE_MODEL": self.base_model,
                "NUM_TRAINERS": str(self.trainers),
                "JOURNEYMAN_UNSLOTH": "1" if self.unsloth else "0",
                "REPORT_TO": " ".join(self.report_to),
            },
        }

    def call(self, action: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Run one SkyPilot action in its environment; its JSON answer (``error`` when it failed)."""
        python = self.python or skypilot_python()
        environment = {**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
        try:
            done = subprocess.run(
                [str(python), "-c", _RUNNER, json.dumps(self.arguments(action))],
                capture_output=True, text=True, env=environment, timeout=timeout or self.timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as error:
            raise BackendError(f"SkyPilot's {action} did not finish within {error.timeout:.0f} s") from error
        answers = [line[len(MARK) :] for line in done.stdout.splitlines() if line.startswith(MARK)]
        if not answers:
            raise BackendError(
                f"SkyPilot's {action} ended ({done.returncode}) without an answer: {done.stderr.strip()[-2000:]}"
            )
        answer: dict[str, Any] = json.loads(answers[-1])
        return answer

    def up(self) -> str:
        """Launch (or reuse) the cluster and return the server's URL."""
        if "JOURNEYMAN_TOKEN" not in os.environ:
            raise ConfigError(
                "export JOURNEYMAN_TOKEN=<a secret of your choice> first: the cloud server listens beyond "
                "loopback, and clients send that token (jm.RemoteBackend(url, token=...))"
            )
        answer = self.call("up")
        if answer.get("error") == "no_cloud":
            python = self.python or skypilot_python()
            raise ConfigError(
                "SkyPilot has no cloud enabled: install your cloud's extra in its environment "
                f"({python.parent}/pip install 'skypilot[aws]==0.14.1', or gcp, azure, kubernetes...), set up "
                f"the cloud's credentials, and check with {python.parent}/sky check"
            )
        if "error" in answer:
            raise BackendError(
                f"SkyPilot could not launch {self.cluster!r}: {answer['error']}: {answer['message']}"
            )
        endpoint = answer.get("endpoint")
        if not endpoint:
            raise BackendError(f"{self.cluster!r} is up but SkyPilot gives no endpoint for port {PORT}")
        return endpoint if endpoint.startswith("http") else f"http://{endpoint}"

    def status(self) -> dict[str, Any]:
        answer = self.call("status", timeout=300)
        if "error" in answer:
            raise BackendError(f"SkyPilot's status failed: {answer['error']}: {answer['message']}")
        return answer

    def down(self) -> None:
        answer = self.call("down", timeout=1800)
        if "error" in answer:
            raise BackendError(
                f"SkyPilot could not tear down {self.cluster!r}: {answer['error']}: {answer['message']}"
            )


class SkyPilotBackend:
    """``journeyman serve`` launched on a cloud GPU, as a connected :class:`~journeyman.RemoteBackend`."""

    @staticmethod
    async def launch(serve: CloudServe | None = None, *, wait: float = 1800.0) -> RemoteBackend:
        """Launch ``serve`` (default: the embedded 135M model on the cheapest GPU), wait until the
        server answers, and return a RemoteBackend on it with ``$JOURNEYMAN_TOKEN``."""
        import asyncio

        serve = serve or CloudServe()
        url = await asyncio.to_thread(serve.up)
        deadline = time.monotonic() + wait
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise BackendError(
                        f"journeyman serve at {url} did not answer /health within {wait:.0f} s"
                    )
                await asyncio.sleep(5)
        return RemoteBackend(url, token=os.environ["JOURNEYMAN_TOKEN"])
