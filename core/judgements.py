"""What a judging produced: a :class:`Score` per trajectory, the :class:`Judgement` of a group,
the judge's JSON answer read and checked, and the on-disk cache of valid answers.
Part of :mod:`journeyman.judge`; names with a leading underscore are its own, not API.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from journeyman.judge_client import Judge

__all__ = ["Judgement", "Score"]

logger = logging.getLogger("journeyman.ruler")

_CACHE_VERSION = 1


@dataclass(frozen=True)
class Score:
    """The judge's score of one trajectory."""

    score: float
    """In [0, 1]: the judge's number, clamped."""
    explanation: str
    raw_score: float
    """What the judge answered, before clamping."""

    @property
    def clamped(self) -> bool:
        return self.score != self.raw_score


@dataclass
class Judgement:
    """One judging of a group: a score per trajectory (in input order) and how it went."""

    scores: list[Score]
    judge: str
    distinct: int
    """Distinct trajectories sent to the judge (identical ones share one score)."""
    attempts: int = 0
    """Judge calls made: 0 when cached, more than 1 after retries."""
    cached: bool = False
    retries: list[str] = field(default_factory=list)
    """Why each failed attempt failed."""
    answer: str | None = None
    """The judge's accepted answer, verbatim (None when cached)."""
    reference: str | None = None
    """How the judge said the task should be done, before it saw an attempt (``reference=True``)."""
    method: str = "scores"
    """How it was judged: ``scores``, ``verdict`` or ``pairwise`` (what ``auto`` became)."""

    @property
    def clamped(self) -> int:
        """How many scores fell outside [0, 1] and were clamped."""
        return sum(score.clamped for score in self.scores)


class InvalidAnswer(ValueError):
    """The judge answered, but not with one valid score per id."""


# The answer -------------------------------------------------------------------------------------


def _scores_object(text: str, ids: list[str]) -> dict[str, Any]:
    """The first JSON object in ``text`` that holds scores (judges wrap it in prose or code fences)."""
    decoder = json.JSONDecoder()
    first_error: json.JSONDecodeError | None = None
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError as error:
            first_error = first_error or error
            continue
        if isinstance(value, dict) and ("scores" in value or any(id_ in value for id_ in ids)):
            return value
    why = f" ({first_error.msg} at position {first_error.pos})" if first_error else ""
    raise InvalidAnswer(f"no JSON object with scores in the answer{why}: {text[:200]!r}")


def _number(value: Any, id_: str) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidAnswer(f"the score of trajectory {id_} is not a finite number: {value!r}")
    return float(value)


def parse_scores(text: str, ids: list[str]) -> dict[str, Score]:
    """One :class:`Score` per id, matched by id; :class:`InvalidAnswer` if the answer is not that."""
    data = _scores_object(text, ids)
    entries: dict[str, Any] = {}
    if isinstance(data.get("scores"), list):  # the list form: {"scores": [{"trajectory_id", "score", ...}]}
        for entry in data["scores"]:
            if not isinstance(entry, dict):
                raise InvalidAnswer(f"a score entry is not an object: {entry!r}")
            id_ = str(entry.get("trajectory_id", entry.get("id")))
            if id_ in entries:
                raise InvalidAnswer(f"trajectory {id_} was scored twice")
            entries[id_] = entry
    else:
        entries = data
    missing = [id_ for id_ in ids if id_ not in entries]
    extra = [id_ for id_ in entries if id_ not in ids]
    if missing or extra:
        raise InvalidAnswer(f"the answer must score ids {ids} once each; missing {missing}, unknown {extra}")
    scores = {}
    for id_ in ids:
        entry = entries[id_]
        raw, explanation = (
            (entry.get("score"), entry.get("explanation", "")) if isinstance(entry, dict) else (entry, "")
        )
        raw_score = _number(raw, id_)
        scores[id_] = Score(min(1.0, max(0.0, raw_score)), str(explanation), raw_score)
    return scores


# The cache --------------------------------------------------------------------------------------


def cache_path(judge: Judge, messages: list[dict[str, str]]) -> Path | None:
    if judge.cache_dir is None:
        return None
    key = json.dumps({"version": _CACHE_VERSION, "judge": judge.name, "messages": messages}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()
    return judge.cache_dir / digest[:2] / f"{digest}.json"


def read_cache(path: Path, ids: list[str]) -> dict[str, Score] | None:
    try:
        data = json.loads(path.read_text())
        return {id_: Score(**data[id_]) for id_ in ids}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring unreadable judge cache entry %s (%s); judging again", path, error)
        return None


def write_cache(path: Path, scores: dict[str, Score]) -> None:
    """Write atomically; a cache that cannot be written costs a later call, never this judgement."""
    data = {id_: score.__dict__ for id_, score in scores.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(data, file)
        os.replace(file.name, path)
    except OSError as error:
        logger.warning(
            "could not write the judge cache entry %s (%s); the next identical judging will call again",
            path,
            error,
        )
