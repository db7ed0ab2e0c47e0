"""A fast, deterministic OpenAI-compatible model for agent tests and benchmarks.

Unlike :mod:`tests.scripted_upstream` (a queue of canned replies), it answers each request from
a policy function of the request, so concurrent agents get the right replies in any order. It
returns what vLLM returns with ``return_token_ids`` and ``logprobs`` (fake but consistent ids:
the UTF-8 bytes of the text), so the real gateway records it as it would the real server.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Policy = Callable[[dict[str, Any]], dict[str, Any]]
"""Request body -> the assistant message to answer with (``content`` and/or ``tool_calls``)."""


def calculator_policy(body: dict[str, Any]) -> dict[str, Any]:
    """Call ``add`` on 'What is A plus B?' (``multiply`` on 'times'), then state the tool's result."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"role": "assistant", "content": f"The answer is {last['content']}."}
    words = str(last.get("content", "")).rstrip("?").split()
    if body.get("tools") and len(words) >= 5 and words[-2] in ("plus", "times"):
        name = "add" if words[-2] == "plus" else "multiply"
        arguments = json.dumps({"a": int(words[-3]), "b": int(words[-1])})
        call = {"id": "", "type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    return {"role": "assistant", "content": "I do not know."}


def _ids(text: str) -> list[int]:
    return list(text.encode())


class ScriptedModel:
    """The app (``.app()``) and what it received (``.received``)."""

    def __init__(self, policy: Policy = calculator_policy) -> None:
        self.policy = policy
        self.received: list[dict[str, Any]] = []
        self._ids = itertools.count()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"])])

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(body)
        message = self.policy(body)
        number = next(self._ids)
        for i, call in enumerate(message.get("tool_calls") or []):
            call["id"] = call["id"] or f"call_{number}_{i}"
        text = (message.get("content") or "") + "".join(
            json.dumps(c["function"]) for c in message.get("tool_calls") or []
        )
        ids = [*_ids(text), 0]
        logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in ids]}
        prompt_ids = _ids(json.dumps(body["messages"]))[:64]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        completion_id = f"chatcmpl-scripted-{number}"
        if body.get("stream"):
            return StreamingResponse(
                self._chunks(completion_id, message, ids, logprobs, prompt_ids, finish),
                media_type="text/event-stream",
            )
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "prompt_token_ids": prompt_ids,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "token_ids": ids,
                    }
                ],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": 0},
            }
        )

    async def _chunks(
        self,
        completion_id: str,
        message: dict[str, Any],
        ids: list[int],
        logprobs: dict[str, Any],
        prompt_ids: list[int],
        finish: str,
    ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": 0, "model": "m"}
            return f"data: {json.dumps({**body, 'choices': [choice]})}\n\n".encode()

        yield chunk({"role": "assistant", "content": ""}).replace(
            b'"choices"', b'"prompt_token_ids": ' + json.dumps(prompt_ids).encode() + b', "choices"'
        )
        delta: dict[str, Any] = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        yield chunk(delta, token_ids=ids, logprobs=logprobs)
        yield chunk({}, finish_reason=finish)
        yield b"data: [DONE]\n\n"
