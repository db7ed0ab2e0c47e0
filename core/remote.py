"""RemoteBackend: the client of ``journeyman serve``, behaving like LocalBackend.

::

    backend = jm.RemoteBackend("http://gpu-box:8000", token="...")
    await model.register(backend)      # the model's OpenAI client now points at the server's /v1
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from journeyman.config import SFTConfig, TrainConfig
from journeyman.errors import BackendError, ConfigError, InvalidDataError, JourneymanError
from journeyman.model import Registration, ServingState, TrainResult
from journeyman.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from journeyman.model import TrainableModel

logger = logging.getLogger(__name__)

__all__ = ["RemoteBackend"]

POLL_SECONDS = 0.5
"""How often :meth:`RemoteBackend.wait_serving` asks the server whether its servers are back."""


class RemoteBackend:
    """Talks to a ``journeyman serve`` server over HTTP."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 3600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0)
        )

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise BackendError(f"could not reach journeyman serve at {self.url}: {error!r}") from error
        _raise_for(response)
        return response.json()

    async def register(self, model: TrainableModel) -> Registration:
        body = {
            "name": model.name,
            "project": model.project,
            "base_model": model.base_model,
            "lora": model.lora.model_dump(),
        }
        answer = await self._call("POST", "/api/models", json=body)
        return Registration(base_url=answer["base_url"], api_key=self.token or "unused", step=answer["step"])

    async def get_step(self, model: TrainableModel) -> int:
        return int((await self._call("GET", f"/api/models/{model.project}/{model.name}/step"))["step"])

    async def train(
        self,
        model: TrainableModel,
        groups: Sequence[TrajectoryGroup],
        config: TrainConfig,
        *,
        promote: bool = True,
    ) -> TrainResult:
        body = (
            '{"groups": ['
            + ", ".join(g.model_dump_json() for g in groups)
            + '], "config": '
            + config.model_dump_json()
            + f', "promote": {json.dumps(promote)}'
            + "}"
        )
        return await self._training(f"/api/models/{model.project}/{model.name}/train", body)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Sequence[Trajectory],
        config: SFTConfig,
        *,
        evaluation: Sequence[Trajectory] | None = None,
        promote: bool = True,
    ) -> TrainResult:
        def listed(items: Sequence[Trajectory]) -> str:
            return "[" + ", ".join(t.model_dump_json() for t in items) + "]"

        body = (
            f'{{"trajectories": {listed(trajectories)}, '
            f'"evaluation": {"null" if evaluation is None else listed(evaluation)}, '
            f'"config": {config.model_dump_json()}, "promote": {json.dumps(promote)}}}'
        )
        return await self._training(f"/api/models/{model.project}/{model.name}/sft", body)

    async def _training(self, path: str, body: str) -> TrainResult:
        """POST a training request and follow its NDJSON events to the result."""
        try:
            async with self._http.stream(
                "POST", path, content=body, headers={"content-type": "application/json"}
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["event"] == "done":
                        return TrainResult(step=event["step"], metrics=event["metrics"])
                    if event["event"] == "batch":  # a supervised run's progress, as the server logs it
                        logger.info(
                            "sft batch %d/%d: loss %.4f",
                            event["sft/batch"],
                            event["total"],
                            event["sft/loss"],
                        )
                    if event["event"] == "error":
                        raise _training_error(event)
        except httpx.HTTPError as error:
            raise BackendError(f"the connection to {self.url} broke during training: {error!r}") from error
        raise BackendError("the server closed the training stream without a result; check its log")

    async def promote(
        self,
        model: TrainableModel,
        step: int,
        *,
        action: str,
        by: str,
        gate: dict[str, Any] | None,
        share: float | None = None,
    ) -> int:
        body = {"step": step, "action": action, "by": by, "gate": gate, "share": share}
        answer = await self._call("POST", f"/api/models/{model.project}/{model.name}/promoted", json=body)
        return int(answer["step"])

    async def record(
        self, model: TrainableModel, row: dict[str, Any], groups: Sequence[TrajectoryGroup] | None = None
    ) -> None:
        """Append a history row this client wrote (a loop's ``rollouts`` row, an evaluation's row
        with its groups) to the server's store, where the model trains and its trackers follow."""
        body = {"row": row, "groups": None if groups is None else [g.model_dump(mode="json") for g in groups]}
        await self._call("POST", f"/api/models/{model.project}/{model.name}/history", json=body)

    async def promoted_step(self, model: TrainableModel) -> int:
        return int((await self._call("GET", f"/api/models/{model.project}/{model.name}/promoted"))["step"])

    async def list_checkpoints(self, model: TrainableModel) -> list[int]:
        answer = await self._call("GET", f"/api/models/{model.project}/{model.name}/checkpoints")
        return [int(step) for step in answer["steps"]]

    async def delete_checkpoints(
        self, model: TrainableModel, best_metric: str | None, *, higher_is_better: bool = True
    ) -> list[int]:
        params = {"best_metric": best_metric} if best_metric else {}
        if not higher_is_better:
            params["lower_is_better"] = "true"
        answer = await self._call(
            "DELETE", f"/api/models/{model.project}/{model.name}/checkpoints", params=params
        )
        return [int(step) for step in answer["deleted"]]

    async def serving_state(self) -> ServingState:
        """The server's restarts of its vLLM servers and whether they are down now; a server too
        old to say (no ``/api/serving``) reports nothing down and no restarts."""
        try:
            response = await self._http.get("/api/serving", timeout=httpx.Timeout(30.0, connect=10.0))
        except httpx.HTTPError as error:
            raise BackendError(f"could not reach journeyman serve at {self.url}: {error!r}") from error
        if response.status_code == 404:  # _raise_for would make this a ConfigError
            return ServingState()
        _raise_for(response)
        answer = response.json()
        return ServingState(
            policy_restarts=int(answer["policy_restarts"]),
            judge_restarts=int(answer["judge_restarts"]),
            policy_down=bool(answer["policy_down"]),
            judge_down=bool(answer["judge_down"]),
        )

    async def wait_serving(self, timeout: float = 900.0, *, judges: bool = False) -> None:
        """Until the server's policy server (``judges``: its judges' servers) answers again; a
        server that cannot be reached meanwhile (restarting, or a proxy in front answering 5xx)
        counts as down. A BackendError once ``timeout`` seconds have passed."""
        what = "judges'" if judges else "policy's"
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = await self.serving_state()
                down, why = (state.judge_down if judges else state.policy_down), "still down"
            except BackendError as error:
                down, why = True, str(error)
            if not down:
                return
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the {what} server of journeyman serve at {self.url} was not back within {timeout:g} s "
                    f"({why}); see the server's log"
                )
            await asyncio.sleep(POLL_SECONDS)

    def viewer_url(self, model: TrainableModel) -> str | None:
        """The page of ``model``'s run in the server's viewer (``/ui``; a browser signs in with the token)."""
        return f"{self.url}/ui/runs/{model.project}/{model.name}"


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    error = ConfigError if response.status_code in (400, 401, 404, 413, 422) else BackendError
    raise error(f"journeyman serve answered {response.status_code}: {message}")


def _training_error(event: dict[str, Any]) -> JourneymanError:
    """The error a training stream ended with: bad data as the client's own InvalidDataError."""
    if event.get("type") == "InvalidDataError":
        return InvalidDataError(f"the server refused the data: {event['message']}")
    return BackendError(f"training failed on the server: {event['message']}")
