"""The gateway's record log: every completion's record, appended to a JSONL file before the client
gets its answer, and found again by completion id or rollout id."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from journeyman.errors import StorageError
from journeyman.records import CompletionRecord

__all__ = ["RecordLog"]


class RecordLog:
    """Completion records: appended to a JSONL file, the most recent kept in memory.

    Memory holds at most ``max_in_memory`` records; older ones are read back from the file on
    demand. Thread-safe.
    """

    def __init__(self, path: Path, *, max_in_memory: int = 10_000, fsync: bool = False) -> None:
        self.path = Path(path)
        self.max_in_memory = max_in_memory
        self.fsync = fsync
        """``True`` also survives power loss (costs a disk flush per completion)."""
        self._recent: OrderedDict[str, CompletionRecord] = OrderedDict()
        self._by_rollout: dict[str, list[str]] = {}
        self._evicted = 0
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as error:
            raise StorageError(f"cannot open the completion records {self.path}: {error}") from error

    def append(self, record: CompletionRecord) -> None:
        """Write the record as one line; :class:`StorageError` (and no partial line) if it cannot."""
        line = (record.model_dump_json() + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise StorageError(f"the completion records {self.path} are closed")
            size = os.fstat(self._fd).st_size
            try:
                if os.write(self._fd, line) != len(line):
                    raise OSError(errno.ENOSPC, "short write")
                if self.fsync:
                    os.fsync(self._fd)
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no torn line for the next record to follow
                raise StorageError(
                    f"could not write a completion record to {self.path}: {error.strerror or error}. "
                    "Free disk space or fix the folder's permissions; this completion was not returned."
                ) from error
            self._recent[record.completion_id] = record
            if record.rollout_id is not None:
                self._by_rollout.setdefault(record.rollout_id, []).append(record.completion_id)
            while len(self._recent) > self.max_in_memory:
                _, old = self._recent.popitem(last=False)
                self._evicted += 1
                if old.rollout_id is not None and (ids := self._by_rollout.get(old.rollout_id)):
                    ids.remove(old.completion_id)
                    if not ids:
                        del self._by_rollout[old.rollout_id]

    def get(self, completion_id: str) -> CompletionRecord | None:
        with self._lock:
            if (record := self._recent.get(completion_id)) is not None or not self._evicted:
                return record
        found = self._scan(lambda r: r.get("completion_id") == completion_id)
        return found[-1] if found else None

    def for_rollout(self, rollout_id: str) -> list[CompletionRecord]:
        """The records of one rollout, in the order they were completed."""
        with self._lock:
            if not self._evicted:
                return [self._recent[i] for i in self._by_rollout.get(rollout_id, [])]
        return self._scan(lambda r: r.get("rollout_id") == rollout_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._recent) + self._evicted

    def _scan(self, keep: Callable[[dict[str, Any]], bool]) -> list[CompletionRecord]:
        records = []
        with open(self.path, encoding="utf-8") as handle:
            for line in handle:
                with contextlib.suppress(ValueError):
                    raw = json.loads(line)
                    if keep(raw):
                        records.append(CompletionRecord.model_validate(raw))
        return records

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
