"""Disk full or an unwritable project folder: a clear error before work is lost."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from journeyman.errors import StorageError
from journeyman.store import check_writable
from tests.scripted_upstream import Reply, ScriptedUpstream

MESSAGES = [{"role": "user", "content": "hi"}]
REPLY = {"id": "c1", "object": "chat.completion", "model": "base", "prompt_token_ids": [1],
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop",
                      "token_ids": [5], "logprobs": {"content": [{"logprob": -0.1}]}}]}  # fmt: skip
CHUNKS = [
    {
        "id": "c2",
        "choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [5]}],
        "prompt_token_ids": [1],
    },
    {
        "id": "c2",
        "choices": [{"index": 0, "delta": {"content": "k"}, "token_ids": [6], "finish_reason": "stop"}],
    },
]


async def test_an_unwritable_project_folder_fails_at_register_before_vllm_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "runs"
    blocker.write_text("a file where the project folder should be")
    async with LocalBackend(root=blocker) as backend:
        model = jm.TrainableModel(name="m", project="p", base_model="smollm2-135m", root=blocker)
        with pytest.raises(StorageError, match=r"could not write in .*runs.*fix the folder's permissions"):
            await model.register(backend)
        assert backend.server is None and backend.gateway is None  # it failed before starting vLLM
    assert blocker.read_text().startswith("a file")


def test_check_writable_creates_the_folder_and_leaves_nothing(tmp_path: Path) -> None:
    folder = check_writable(tmp_path / "a" / "b")
    assert folder.is_dir() and list(folder.iterdir()) == []
    with pytest.raises(StorageError):
        check_writable("/proc/journeyman-cannot-be-here")


@pytest.fixture
def full_gateway(
    scripted: tuple[ScriptedUpstream, Router],
) -> Iterator[tuple[ScriptedUpstream, GatewayThread]]:
    """A gateway whose record file is /dev/full: every write fails with ENOSPC, for real."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    upstream, router = scripted
    records = RecordLog(Path("/dev/full"))
    with GatewayThread(Gateway(router, records)) as gateway:
        yield upstream, gateway
    records.close()


def test_a_completion_that_cannot_be_recorded_is_not_returned(
    full_gateway: tuple[ScriptedUpstream, GatewayThread],
) -> None:
    upstream, gateway = full_gateway
    upstream.replies += [Reply(body=REPLY), Reply(chunks=CHUNKS)]
    url = f"{gateway.base_url}/v1/chat/completions"
    response = httpx.post(url, json={"model": "base", "messages": MESSAGES})
    assert response.status_code == 507
    error = response.json()["error"]
    assert error["type"] == "storage_error" and "No space left on device" in error["message"]
    assert "Free disk space" in error["message"] and "ok" not in response.text

    with httpx.stream("POST", url, json={"model": "base", "messages": MESSAGES, "stream": True}) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events  # a stream that could not be recorded never ends cleanly
    assert json.loads(events[-1])["error"]["type"] == "storage_error"
    assert len(gateway.gateway.records) == 0


def test_a_short_write_leaves_no_torn_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from journeyman.records import CompletionRecord

    log = RecordLog(tmp_path / "records.jsonl")
    record = CompletionRecord.model_validate(
        {"completion_id": "a", "requested_model": "m", "served_model": "m", "started_at": "2026-01-01T00:00:00Z",
         "finished_at": "2026-01-01T00:00:01Z", "upstream_seconds": 1.0, "choices": [{"completion_token_ids": [1]}]}
    )  # fmt: skip
    log.append(record)
    real_write = os.write

    def half(fd: int, data: bytes) -> int:
        return real_write(fd, data[: len(data) // 2])  # the disk filled up halfway through

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(StorageError, match="could not write a completion record"):
        log.append(record.model_copy(update={"completion_id": "b"}))
    monkeypatch.undo()
    log.append(record.model_copy(update={"completion_id": "c"}))
    log.close()
    ids = [
        json.loads(line)["completion_id"] for line in (tmp_path / "records.jsonl").read_text().splitlines()
    ]
    assert ids == ["a", "c"]
    assert log.get("b") is None


def test_records_in_an_unwritable_place_fail_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot open the completion records"):
        RecordLog(blocker / "records.jsonl")
