"""A scripted OpenAI-compatible judge, for tests that need exact control of the judge's answers.

It serves real HTTP (uvicorn on a thread, like :mod:`tests.scripted_upstream`) and answers each
chat completion with the next scripted :class:`Reply`: text (or a function of the trajectory ids
the request asks about), an error status, or a delay.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.scripted_upstream import serve


@dataclass
class Reply:
    content: str | Callable[[list[str]], str] = ""
    """The judge's answer; a callable gets the ids the request asks to score."""
    status: int = 200
    delay: float = 0.0
    """Seconds to wait before answering (longer than the judge's timeout: a timeout)."""
    top_logprobs: dict[str, float] | None = None
    """The first token's likeliest alternatives and their logprobs, as vLLM returns them with
    ``logprobs=True``; the first is the token answered."""


def scores(
    *values: Any, order: Callable[[list[str]], list[str]] = list, **extra: Any
) -> Callable[[list[str]], str]:
    """An answer giving ``values[i]`` to the i-th id asked about, keys written in ``order(ids)``."""

    def answer(ids: list[str]) -> str:
        given = dict(zip(ids, values, strict=True))
        body = {
            id_: {"explanation": f"trajectory {id_} is worth {given[id_]}", "score": given[id_]}
            for id_ in order(ids)
        }
        return json.dumps({**body, **extra})

    return answer


def reversed_ids(ids: list[str]) -> list[str]:
    return ids[::-1]


def trajectory_texts(request: dict[str, Any]) -> dict[str, str]:
    """What a judge request shows of each trajectory, by id, in the order shown."""
    prompt = request["messages"][-1]["content"]
    return dict(re.findall(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', prompt, re.DOTALL))


@dataclass
class ScriptedJudge:
    replies: list[Reply] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    reject_schema: bool = False
    """Answer 400 to requests with ``response_format``, like an endpoint without structured output."""
    in_flight: int = 0
    max_in_flight: int = 0
    respond: Callable[[dict[str, Any]], Reply] | None = None
    """Answer every request from its body instead of from ``replies`` (a judge that reads)."""

    @staticmethod
    def ids(request: dict[str, Any]) -> list[str]:
        """The trajectory ids a judge request asks about, from its schema or its prompt."""
        schema = request.get("response_format", {}).get("json_schema", {}).get("schema")
        if schema is not None:
            return list(schema["required"])
        return re.findall(r'<trajectory id="([^"]+)">', request["messages"][-1]["content"])

    def app(self) -> Starlette:
        async def complete(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append(body)
            if self.reject_schema and "response_format" in body:
                error = {"message": "response_format is not supported", "type": "BadRequestError"}
                return JSONResponse({"error": error}, status_code=400)
            if self.respond is not None:
                reply = self.respond(body)
            elif not self.replies:
                return JSONResponse({"error": {"message": "the script has no reply left"}}, status_code=418)
            else:
                reply = self.replies.pop(0)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(reply.delay)
            finally:
                self.in_flight -= 1
            if reply.status != 200:
                return JSONResponse(
                    {"error": {"message": f"scripted {reply.status}"}}, status_code=reply.status
                )
            content = reply.content(self.ids(body)) if callable(reply.content) else reply.content
            message = {"role": "assistant", "content": content}
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "stop"}
            if reply.top_logprobs is not None:
                top = [{"token": t, "logprob": lp, "bytes": None} for t, lp in reply.top_logprobs.items()]
                message["content"] = top[0]["token"] if top else ""
                choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}] if top else []}
            return JSONResponse(
                {
                    "id": f"chatcmpl-{len(self.received)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"])])


@contextmanager
def running(judge: ScriptedJudge) -> Iterator[str]:
    """Serve the scripted judge; yields its base URL (``.../v1``)."""
    thread = serve(judge.app())
    try:
        yield f"{thread.base_url}/v1"
    finally:
        thread.stop()
