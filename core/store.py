"""The on-disk store of a model's runs.

Layout under a root folder (``.journeyman`` in the working directory unless ``JOURNEYMAN_ROOT``
or ``root=`` says otherwise)::

    <root>/<project>/<model>/
        trajectories/<split>/<step:04d>.jsonl   one TrajectoryGroup per line
        history.jsonl                           one row of metrics per logged step
        checkpoints/<step:04d>/                 adapter + optimizer + trainer state
    <root>/gateway/completions.jsonl            a LocalBackend gateway's record of every completion
    <root>/logs/                                its servers' logs

Every write is atomic: data goes to a hidden temporary file (or folder) next to its target,
is flushed to disk, then renamed over the target. Readers never see half-written data, and
they ignore the hidden temporary names a crash may leave behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from journeyman.errors import ConfigError, InvalidDataError, StorageError
from journeyman.trajectory import TrajectoryGroup, load_group

__all__ = [
    "CHECKPOINT_STATE",
    "PROMOTION_ACTIONS",
    "ModelStore",
    "atomic_dir",
    "atomic_write",
    "check_writable",
    "default_root",
    "validate_name",
]

CHECKPOINT_STATE = "trainer_state.json"
"""The trainer's state in a checkpoint folder (step, metrics, config), beside the adapter."""
PROMOTION_ACTIONS = ("promote", "rollback", "hold", "canary")
"""What a promotions.jsonl row records: the plain name moved forward, moved back, a gate held it,
or a share of rollouts went to a candidate (``share`` 0 ends it)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_name(value: str, kind: str = "name") -> str:
    """Check a project, model or split name is safe as one path component; return it."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise ConfigError(
            f"invalid {kind} {value!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it becomes a folder name, so no '/', no '..', no spaces)"
        )
    return value


def default_root() -> Path:
    """``$JOURNEYMAN_ROOT`` if set, else ``./.journeyman``."""
    return Path(os.environ.get("JOURNEYMAN_ROOT", ".journeyman"))


def _storage_error(action: str, path: Path, error: OSError) -> StorageError:
    reason = error.strerror or str(error)
    return StorageError(
        f"could not {action} {path}: {reason}. Free disk space or fix the folder's permissions, or "
        "point JOURNEYMAN_ROOT (or root=...) at a writable folder. Nothing already stored was changed."
    )


def check_writable(folder: str | os.PathLike[str]) -> Path:
    """Create ``folder`` if needed and check a file can be written in it, before any work starts."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise _storage_error("write in", path, error) from error
    return path


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a mix."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise _storage_error("create a file next to", path, error) from error
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes files private; give them the usual mode
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise _storage_error("write", path, error) from error
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Build a folder under a hidden temporary name; it appears at ``path`` only when complete.

    Yields the temporary folder to write into. If the block raises, the temporary folder is
    removed and ``path`` is untouched. An existing ``path`` is replaced.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as error:
        raise _storage_error("create a folder next to", path, error) from error
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes folders private; give them the usual mode
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _storage_error("write the folder", path, error) from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_thread_locks: dict[Path, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Serialise read-modify-write of ``path`` across threads and processes."""
    key = path.absolute()
    with _thread_locks_guard:
        lock = _thread_locks.setdefault(key, threading.Lock())
    with lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path.with_name(f".{path.name}.lock"), "a")  # noqa: SIM115
        except OSError as error:
            raise _storage_error("lock", path, error) from error
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _follows_training(rows: list[dict[str, Any]]) -> bool:
    if not rows:
        return True
    last = rows[-1]
    return bool(last.get("action") == "promote" and last.get("by") == "train" and not last.get("pinned"))


def _append_line(path: Path, lines: Iterable[str]) -> None:
    """Append lines to a JSONL file by an atomic rewrite (the file is small: one line per step/group)."""
    with _exclusive(path):
        old = _read_text(path)
        atomic_write(path, old + "".join(line + "\n" for line in lines))


def _visible_steps(folder: Path, suffix: str = "") -> list[int]:
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        stem = entry.name[: len(entry.name) - len(suffix)] if suffix else entry.name
        if not entry.name.startswith(".") and entry.name.endswith(suffix) and stem.isdigit():
            steps.append(int(stem))
    return sorted(steps)


class ModelStore:
    """The folder of one model of one project, and atomic reads and writes inside it."""

    def __init__(self, project: str, model: str, root: str | os.PathLike[str] | None = None) -> None:
        self.project = validate_name(project, "project name")
        self.model = validate_name(model, "model name")
        self.root = Path(root) if root is not None else default_root()
        self.path = self.root / self.project / self.model

    @classmethod
    def from_path(cls, run_dir: str | os.PathLike[str]) -> ModelStore:
        """The store whose folder is ``run_dir`` (``ROOT/PROJECT/MODEL``, as a run prints it)."""
        path = Path(run_dir).resolve()
        return cls(path.parent.name, path.name, root=path.parents[1])

    def __repr__(self) -> str:
        return f"ModelStore({str(self.path)!r})"

    @property
    def history_path(self) -> Path:
        return self.path / "history.jsonl"

    @property
    def checkpoints_path(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs_path(self) -> Path:
        """Server logs (vLLM, gateway)."""
        return self.path / "logs"

    @property
    def records_path(self) -> Path:
        """The gateway's completion records (JSONL, appended)."""
        return self.path / "records" / "completions.jsonl"

    def trajectories_path(self, split: str, step: int) -> Path:
        return self.path / "trajectories" / validate_name(split, "split") / f"{_check_step(step):04d}.jsonl"

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_path / f"{_check_step(step):04d}"

    # Trajectories ----------------------------------------------------------------------------

    def save_groups(self, groups: Iterable[TrajectoryGroup], split: str, step: int) -> Path:
        """Add groups to the file of ``split`` at ``step`` (earlier groups there are kept)."""
        path = self.trajectories_path(split, step)
        _append_line(path, [group.model_dump_json() for group in groups])
        return path

    def load_groups(self, split: str, step: int) -> list[TrajectoryGroup]:
        """The groups stored for ``split`` at ``step``; an error names the file and line of bad data."""
        path = self.trajectories_path(split, step)
        groups = []
        for number, line in enumerate(_read_lines(path), start=1):
            try:
                groups.append(load_group(line))
            except InvalidDataError as error:
                raise InvalidDataError(f"{path}, line {number}: {error}") from None
        return groups

    def splits(self) -> list[str]:
        folder = self.path / "trajectories"
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))

    def steps(self, split: str) -> list[int]:
        """Steps that have stored trajectories for ``split``, ascending."""
        return _visible_steps(self.path / "trajectories" / validate_name(split, "split"), ".jsonl")

    # History ---------------------------------------------------------------------------------

    def append_history(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append a row of metrics (must hold ``step``); ``time`` is added when absent."""
        if "step" not in row:
            raise InvalidDataError("a history row needs a 'step' (the training step it belongs to)")
        row = {"time": datetime.now(UTC).isoformat(), **row}
        try:
            line = json.dumps(row, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidDataError(
                f"history row is not JSON-serialisable with finite numbers ({error}); got keys {sorted(row)}"
            ) from None
        _append_line(self.history_path, [line])
        return row

    def read_history(self) -> list[dict[str, Any]]:
        return _read_rows(self.history_path)

    # Promotions ------------------------------------------------------------------------------

    @property
    def promotions_path(self) -> Path:
        """Each move of the plain name (promote, rollback) and each gate that held it (JSONL)."""
        return self.path / "promotions.jsonl"

    def append_promotion(self, row: dict[str, Any]) -> dict[str, Any]:
        """Record a promotion decision: ``action`` (promote, rollback, hold, canary), ``step``, and
        who and why (``by``, ``gate``, ``share``); ``time`` is added when absent."""
        if row.get("action") not in PROMOTION_ACTIONS or not isinstance(row.get("step"), int):
            raise InvalidDataError(
                f"a promotion row needs an action ({', '.join(PROMOTION_ACTIONS)}) and an integer step, got {row}"
            )
        row = {"time": datetime.now(UTC).isoformat(), **row}
        _append_line(self.promotions_path, [json.dumps(row, allow_nan=False)])
        return row

    def read_promotions(self) -> list[dict[str, Any]]:
        return _read_rows(self.promotions_path)

    def promoted_step(self) -> int | None:
        """The step the plain name serves: the last promotion or rollback recorded; None when none
        was (then it is the latest step). While training promotes each step it finishes, a later
        checkpoint than the last such row is served too: its row was lost with a process killed
        between the checkpoint and the row."""
        rows = self.read_promotions()
        moves = [row for row in rows if row.get("action") in ("promote", "rollback")]
        if not moves:
            return None
        step = int(moves[-1]["step"])
        steps = self.checkpoint_steps()
        return max(step, steps[-1]) if steps and _follows_training(rows) else step

    def follows_training(self) -> bool:
        """Whether the plain name follows each step training finishes: nothing recorded yet, or
        last a training step's own promotion (not one pinned by ``promote=False``, a gate's hold,
        a canary or a move by hand)."""
        return _follows_training(self.read_promotions())

    def running_canary(self) -> tuple[int, float] | None:
        """(step, share) of a canary still running: started after the last promotion, rollback or
        hold, and not ended (share 0); None when there is none."""
        canary = None
        for row in self.read_promotions():
            share = float(row.get("share") or 0)
            canary = (int(row["step"]), share) if row.get("action") == "canary" and share > 0 else None
        return canary

    # Checkpoints -----------------------------------------------------------------------------

    def checkpoint_steps(self) -> list[int]:
        """Steps with a complete checkpoint folder, ascending (temporary folders are ignored)."""
        return _visible_steps(self.checkpoints_path)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        steps = self.checkpoint_steps()
        return (steps[-1], self.checkpoint_path(steps[-1])) if steps else None

    def best_step(self, metric: str, *, higher_is_better: bool = True) -> int | None:
        """The checkpointed step whose history rows have the best mean of ``metric``."""
        by_step: dict[int, list[float]] = {}
        for row in self.read_history():
            value = row.get(metric)
            if isinstance(value, int | float) and not isinstance(value, bool):
                by_step.setdefault(int(row["step"]), []).append(float(value))
        candidates = [
            (sum(v) / len(v), step) for step, v in by_step.items() if step in self.checkpoint_steps()
        ]
        if not candidates:
            return None
        return (max if higher_is_better else min)(candidates)[1]

    def prune_checkpoints(
        self, best_metric: str | None = "val/reward", *, higher_is_better: bool = True
    ) -> list[int]:
        """Delete every checkpoint but the latest, the promoted one, a running canary's and the best
        by ``best_metric``; return the deleted steps."""
        steps = self.checkpoint_steps()
        keep = {steps[-1]} if steps else set()
        if (promoted := self.promoted_step()) is not None:
            keep.add(promoted)
        if (canary := self.running_canary()) is not None:
            keep.add(canary[0])
        if (
            best_metric is not None
            and (best := self.best_step(best_metric, higher_is_better=higher_is_better)) is not None
        ):
            keep.add(best)
        deleted = [step for step in steps if step not in keep]
        for step in deleted:
            folder = self.checkpoint_path(step)
            hidden = folder.with_name(f".{folder.name}.deleting")
            try:
                os.replace(folder, hidden)  # vanishes at once for readers, then removed
            except OSError as error:
                raise _storage_error("delete", folder, error) from error
            shutil.rmtree(hidden, ignore_errors=True)
        return deleted

    def write_checkpoint(self, step: int) -> contextlib.AbstractContextManager[Path]:
        """``with store.write_checkpoint(step) as folder:`` write files; it appears when complete."""
        return atomic_dir(self.checkpoint_path(step))


def _check_step(step: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidDataError(f"a step must be a non-negative integer, got {step!r}")
    return step


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
    except OSError as error:
        raise _storage_error("read", path, error) from error


def _read_lines(path: Path) -> list[str]:
    # Split on "\n" only: splitlines() also splits on U+0085, U+2028, ..., which JSON leaves unescaped.
    return [line for line in _read_text(path).split("\n") if line.strip()]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of a JSONL file; an error names the line that is not JSON."""
    rows = []
    for number, line in enumerate(_read_lines(path), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise InvalidDataError(f"{path}, line {number}: not JSON ({error.msg})") from None
    return rows
