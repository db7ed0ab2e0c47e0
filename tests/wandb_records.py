"""A W&B run file (``run-<id>.wandb``) read back with wandb's own protobuf schema.

wandb 0.31 has no Python reader left, so the tests read the file as wandb writes it: a 7-byte
header (``:W&B``, the magic 0xBEE1 little-endian, format version 0), then LevelDB-log blocks of
32 KiB whose chunks (a 7-byte header: CRC-32 of type and data, length, type) carry serialised
``wandb_internal_pb2.Record`` messages. A change of that format fails here, loudly.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = struct.Struct("<IHB")  # checksum, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    """Every record of the run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    magic, version = data[:4], data[4:7]
    assert magic == b":W&B", f"{path}: not a W&B run file (header {magic!r})"
    assert struct.unpack("<H", version[:2])[0] == 0xBEE1 and version[2] == 0, f"{path}: format {version!r}"
    position, pending = 7, b""
    while position + HEADER.size <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER.size:  # the block's tail is padding
            position += left_in_block
            continue
        checksum, length, kind = HEADER.unpack_from(data, position)
        if kind == 0 and length == 0:
            position += left_in_block
            continue
        chunk = data[position + HEADER.size : position + HEADER.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == checksum, (
            f"{path}: bad checksum at {position}"
        )
        position += HEADER.size + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def finished(path: Path, timeout: float = 60.0) -> Path:
    """``path`` once it holds the run's exit record: wandb's service may still be writing the
    file when ``run.finish()`` has returned."""
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)
    return path


def run_file(folder: Path) -> Path:
    """The one ``run-*.wandb`` under ``folder``, finished."""
    (found,) = folder.rglob("run-*.wandb")
    return finished(found)


def history(path: Path) -> list[dict[str, Any]]:
    """The rows ``run.log`` wrote, each as {key: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def artifacts(path: Path) -> list[Any]:
    """The artifact records (name, type, digest, aliases, manifest)."""
    return [r.artifact for r in records(path) if r.WhichOneof("record_type") == "artifact"]


def config(path: Path) -> dict[str, Any]:
    """The run's config, as its last config record left it."""
    found: dict[str, Any] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = (
            record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        )
        for item in updates:
            if item.key != "_wandb":
                found[item.key] = json.loads(item.value_json)
    return found
