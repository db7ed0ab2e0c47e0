"""A scripted stand-in for vLLM's OpenAI server, for gateway tests that need exact control.

It serves real HTTP (uvicorn on a thread) and answers each request with the next scripted
reply: a JSON body, a list of SSE chunks, an error status, or a hang.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from journeyman.backend.serving.gateway import GatewayThread
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer


@dataclass
class Reply:
    body: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] | None = None
    status: int = 200
    hang: bool = False


@dataclass
class ScriptedUpstream:
    replies: list[Reply] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def complete(request: Request) -> Response:
            self.received.append(json.loads(await request.body()))
            self.headers.append(dict(request.headers))
            reply = self.replies.pop(0)
            if reply.hang:
                await asyncio.sleep(5)
            if reply.chunks is not None:
                return StreamingResponse(_sse(reply.chunks), media_type="text/event-stream")
            return JSONResponse(reply.body, status_code=reply.status)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", complete, methods=["POST"]),
                Route("/v1/completions", complete, methods=["POST"]),
            ]
        )


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


class ScriptedServer(VLLMServer):
    """A VLLMServer whose 'process' is a scripted upstream (or nothing) at a given URL."""

    def __init__(self, url: str, *, running: bool = True, log_dir: Path) -> None:
        super().__init__(VLLMConfig(model="scripted", served_name="base"), log_path=log_dir / "scripted.log")
        self._url = url
        self.running = running

    @property
    def base_url(self) -> str:
        return self._url

    def is_running(self) -> bool:
        return self.running


def serve(app: Starlette) -> GatewayThread:
    """Run any ASGI app on a free loopback port, on a thread (reusing the gateway's runner)."""

    class _App:
        def __init__(self, asgi: Starlette) -> None:
            self.app = asgi

    return GatewayThread(_App(app), shutdown_timeout=1).start()  # type: ignore[arg-type]


def gateway_to(server: VLLMServer, tmp_path: Path, **kwargs: Any) -> GatewayThread:
    """The real gateway in front of ``server``, recording to ``tmp_path/records.jsonl``, started."""
    from journeyman.backend.serving.gateway import Gateway, RecordLog
    from journeyman.backend.serving.router import Router

    return GatewayThread(Gateway(Router(server), RecordLog(tmp_path / "records.jsonl"), **kwargs)).start()
