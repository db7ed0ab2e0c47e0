"""Reading a gateway's completion records over HTTP (or in process, when the gateway runs here).
Part of the capture kit, :mod:`journeyman.integrations.capture`, which re-exports these names."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

import httpx
from pydantic import TypeAdapter

from journeyman.records import CompletionRecord, RecordSource, in_process_records

__all__ = ["HttpRecords", "gateway_records", "gateway_root", "http_records"]

logger = logging.getLogger("journeyman.integrations")


_ROLLOUT_SUFFIX = re.compile(r"(/r/[^/]+)?/v1/?$")


def gateway_root(base_url: str) -> str:
    """``http://host:port`` from an OpenAI base URL of the gateway (``.../v1`` or ``.../r/<id>/v1``)."""
    return _ROLLOUT_SUFFIX.sub("", base_url.rstrip("/"))


class HttpRecords:
    """Records read from a gateway over HTTP, on one kept-alive client.

    ``get`` asks ``GET /records/<completion_id>``; ``get_many`` asks for up to 50 records in one
    ``GET /records?completion_id=...`` (one request per id from a gateway that predates it). An
    endpoint that answers like no journeyman gateway (a 404 without the gateway's error, a 401)
    is asked once: later lookups return nothing without a request.
    """

    batch = 50

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 10.0) -> None:
        self.root = gateway_root(base_url)
        self.is_gateway: bool | None = None
        """None until the first answer; False for an endpoint that is not a journeyman gateway."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.root, headers=headers, timeout=timeout)

    def get(self, completion_id: str) -> CompletionRecord | None:
        if self.is_gateway is False:
            return None
        response = self._client.get(f"/records/{completion_id}")
        if response.status_code == 200:
            self.is_gateway = True
            return CompletionRecord.model_validate_json(response.content)
        if response.status_code == 404 and b'"not_found"' in response.content:
            self.is_gateway = True
            return None
        self._refused(response)
        return None

    def get_many(self, completion_ids: Sequence[str]) -> dict[str, CompletionRecord]:
        """The records found for these ids, by id."""
        found: dict[str, CompletionRecord] = {}
        for start in range(0, len(completion_ids), self.batch):
            if self.is_gateway is False:
                break
            chunk = list(completion_ids[start : start + self.batch])
            response = self._client.get("/records", params={"completion_id": chunk})
            if response.status_code == 200:
                self.is_gateway = True
                records = _RECORD_LIST.validate_json(response.content)["records"]
                found.update((r.completion_id, r) for r in records)
            elif response.status_code == 400:  # a gateway that only lists by ?rollout_id=
                found.update((i, r) for i in chunk if (r := self.get(i)) is not None)
            else:
                self._refused(response)
        return found

    def _refused(self, response: httpx.Response) -> None:
        if response.status_code in (401, 403):
            self.is_gateway = False
            logger.warning(
                "%s refused to hand out completion records (%d): calls to it are kept without token ids. "
                "If it is `journeyman serve` with a token, give the tracer api_key=<that token>",
                self.root,
                response.status_code,
            )
        elif response.status_code in (404, 405):
            self.is_gateway = False
            logger.info("%s is not a journeyman gateway: its calls are kept without token ids", self.root)
        else:
            response.raise_for_status()

    def close(self) -> None:
        self._client.close()


_RECORD_LIST = TypeAdapter(dict[str, list[CompletionRecord]])
_shared: dict[tuple[str, str | None], HttpRecords] = {}
_shared_lock = threading.Lock()


def http_records(base_url: str, api_key: str | None = None) -> HttpRecords:
    """The process-wide :class:`HttpRecords` for a gateway (tracers made per run share its connections)."""
    key = (gateway_root(base_url), api_key)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = HttpRecords(base_url, api_key)
        return _shared[key]


def gateway_records(base_url: str, api_key: str | None = None) -> RecordSource:
    """Where to read a gateway's records: its ``RecordLog`` when it runs in this process, else HTTP."""
    local = in_process_records(gateway_root(base_url))  # not `or`: an empty RecordLog is falsy
    return local if local is not None else http_records(base_url, api_key)
