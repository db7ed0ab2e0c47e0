"""Adapters that travel between machines: a tar of the peft adapter folder, and the client that
pushes each trained step to the inference machines.

Separate trainer and inference machines: the trainer pushes each new adapter to remote gateways.
A ``journeyman serve`` on an inference machine accepts one over its authenticated API::

    PUT /api/deployments/{name}/{step}?base_model=...    body: a tar of the peft adapter folder

It stores the folder under ``<root>/deployments/<name>/<step>``, starts vLLM on ``base_model``
if it is not serving yet, and points ``name`` at ``name@step`` (the same :meth:`Router.deploy`
as a local step). On the trainer, :class:`AdapterPush` is the ``deploy`` callback that sends it.

Only the files of a peft adapter travel (``adapter_config.json``, ``adapter_model.safetensors``,
``README.md``): no pickle, no paths, no links.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from journeyman.errors import AdapterError, ConfigError, InvalidDataError

__all__ = ["ADAPTER_FILES", "AdapterPush", "pack_adapter", "unpack_adapter"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")


def pack_adapter(folder: Path) -> bytes:
    """The adapter folder as an uncompressed tar (safetensors do not compress)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ADAPTER_FILES:
            if (folder / name).is_file():
                tar.add(folder / name, arcname=name)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise AdapterError(f"{folder} is not a peft adapter folder: {', '.join(missing)} missing")
    return buffer.getvalue()


def unpack_adapter(data: bytes, folder: Path) -> None:
    """Write the adapter files of a tar into ``folder``; refuse anything else."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                if member.name not in ADAPTER_FILES or not member.isfile():
                    raise InvalidDataError(
                        f"the adapter upload holds {member.name!r}; only the files "
                        f"{', '.join(ADAPTER_FILES)} of a peft adapter folder are accepted"
                    )
            names = {member.name for member in members}
            missing = [name for name in REQUIRED_FILES if name not in names]
            if missing:
                raise InvalidDataError(f"the adapter upload lacks {', '.join(missing)}")
            for member in members:
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                (folder / member.name).write_bytes(source.read())
    except tarfile.TarError as error:
        raise InvalidDataError(f"the adapter upload is not a tar archive: {error}") from error


class AdapterPush:
    """Pushes adapters to the ``journeyman serve`` of each inference machine.

    ``AdapterPush(["http://10.0.0.2:8000"], token).deployer("agent", base_model)`` is a
    trainer ``deploy`` callback: each new step is served by every gateway before the step is
    reported done; a gateway that refuses it raises :class:`AdapterError` naming it.
    """

    def __init__(self, urls: Sequence[str], token: str | None = None, *, timeout: float = 300.0) -> None:
        if not urls:
            raise ConfigError("AdapterPush needs at least one gateway URL, e.g. http://10.0.0.2:8000")
        self.urls = [url.rstrip("/") for url in urls]
        self.token = token
        self.timeout = timeout

    async def push(
        self, name: str, base_model: str, folder: Path, step: int, *, existing_ok: bool = False
    ) -> list[str]:
        """Send ``folder`` as ``name@step`` to every gateway at once; their served names.

        ``existing_ok``: a gateway that already serves this step (409) counts as done.
        """
        data = await asyncio.to_thread(pack_adapter, Path(folder))
        headers = {"content-type": "application/x-tar"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        async with httpx.AsyncClient(timeout=self.timeout) as client:

            async def one(url: str) -> str:
                try:
                    response = await client.put(
                        f"{url}/api/deployments/{name}/{step}",
                        params={"base_model": base_model},
                        content=data,
                        headers=headers,
                    )
                except httpx.HTTPError as error:
                    raise AdapterError(f"could not push {name}@{step} to {url}: {error!r}") from error
                if response.status_code == 409 and existing_ok:
                    return f"{name}@{step}"
                if response.status_code != 200:
                    raise AdapterError(
                        f"{url} refused {name}@{step} ({response.status_code}): {_message(response)}"
                    )
                return str(response.json()["served_name"])

            return list(await asyncio.gather(*(one(url) for url in self.urls)))

    def deployer(self, name: str, base_model: str) -> Callable[[Path, int], Awaitable[Any]]:
        async def deploy(folder: Path, step: int) -> list[str]:
            return await self.push(name, base_model, folder, step)

        return deploy


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300]
