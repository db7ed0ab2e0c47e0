"""A streamed chat completion as the Responses API's server-sent events.

The gateway streams ``/v1/responses`` by streaming the chat completion it runs as: text arrives
as ``response.output_text.delta`` events while the model writes it, tool calls as whole
``function_call`` items once the stream has ended (the tool parser knows a call only when it is
complete), and ``response.completed`` carries the whole response, as OpenAI's API sends it.
"""

from __future__ import annotations

import time
from typing import Any

from journeyman.responses import response_id, response_object

__all__ = ["ResponseEvents"]


class ResponseEvents:
    """The events of one streamed response, built chunk by chunk; every event is numbered."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.id: str | None = None
        self.created_at = time.time()
        self._sequence = 0
        self._text: list[str] = []
        self._started_text = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _response(self, **answer: Any) -> dict[str, Any]:
        assert self.id is not None
        answer.setdefault("message", None)
        answer.setdefault("finish_reason", None)
        answer.setdefault("usage", None)
        return response_object(
            self.request, self.id, model=self.request["model"], created_at=self.created_at, **answer
        )

    @property
    def _message_id(self) -> str:
        assert self.id is not None
        return "msg_" + self.id.removeprefix("resp_")

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events a chat chunk makes: ``response.created`` first, then text deltas."""
        events = []
        if self.id is None:
            self.id = response_id(str(chunk.get("id") or f"missing-{time.time_ns()}"))
            events.append(self._event("response.created", response=self._response()))
            events.append(self._event("response.in_progress", response=self._response()))
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if choice.get("index", 0) != 0 or not text:
                continue
            if not self._started_text:
                self._started_text = True
                item = {
                    "type": "message",
                    "id": self._message_id,
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": []}
                events.append(self._event("response.output_item.added", output_index=0, item=item))
                events.append(self._event("response.content_part.added", **self._at(), part=part))
            self._text.append(text)
            events.append(self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[]))
        return events

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._message_id, "output_index": 0, "content_index": 0}

    def done(
        self,
        message: dict[str, Any],
        finish_reason: str | None,
        usage: dict[str, Any] | None,
        logprobs: Any = None,
    ) -> list[dict[str, Any]]:
        """The closing events: the text's end, each tool call, ``response.completed``."""
        if self.id is None:  # a stream with no chunk at all
            self.id = response_id(f"missing-{time.time_ns()}")
        response = self._response(
            message=message, finish_reason=finish_reason, usage=usage, logprobs=logprobs
        )
        events = []
        items = response["output"]
        for index, item in enumerate(items):
            if item["type"] == "message":
                part = item["content"][0]
                if not self._started_text:
                    empty = {**item, "status": "in_progress", "content": []}
                    events.append(self._event("response.output_item.added", output_index=index, item=empty))
                    events.append(
                        self._event("response.content_part.added", **self._at(), part={**part, "text": ""})
                    )
                events.append(
                    self._event("response.output_text.done", **self._at(), text=part["text"], logprobs=[])
                )
                events.append(self._event("response.content_part.done", **self._at(), part=part))
            else:
                started = {**item, "arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", output_index=index, item=started))
                at = {"item_id": item["id"], "output_index": index}
                events.append(
                    self._event("response.function_call_arguments.delta", **at, delta=item["arguments"])
                )
                events.append(
                    self._event("response.function_call_arguments.done", **at, arguments=item["arguments"])
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response))
        return events
