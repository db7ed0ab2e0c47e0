"""RULER-style group judging: an LLM judge scores the attempts of one group side by side.

GRPO needs only relative rewards within a group, and a judge ranks several attempts at the same
task more reliably than it scores one attempt alone. So a task with no programmatic success
check can still be trained on::

    judge = jm.Judge(model="base", base_url=f"{gateway_url}/v1")
    groups = await jm.gather_trajectory_groups(
        (jm.TrajectoryGroup(rollout(s) for _ in range(4)) for s in scenarios),
        after_each=lambda group: jm.ruler_score_group(group, judge=judge),
    )

What the judge sees: the tools, one line each, once when all histories share them (else with each
history); the messages every trajectory starts with, once, as ``<context>``; then each distinct
trajectory under an id, with every history it holds. Messages read as a tagged transcript
(``<user>``, ``<assistant>``, ``<call>add {"a": 2, "b": 3}</call>``, ``<tool name="add">5</tool>``),
not as API JSON: call ids and empty fields tell a judge nothing and cost a small one a third of
what it reads. Trajectories that read the same are judged once and share the score.

What is checked: the answer is a JSON schema-constrained object where the endpoint supports it,
else found in free text. Scores are matched to trajectories by id, never by position; a score
outside [0, 1] is clamped and counted. Malformed JSON, a missing, extra or repeated id, a timeout
or an HTTP 5xx is answered by asking again, up to ``judge.max_retries`` times; then
:class:`~journeyman.errors.JudgeError`. :func:`ruler_score_group` records that error on the group
as a :class:`~journeyman.trajectory.Failure` and leaves the trajectories without a reward (the
trainer skips them), or gives them ``fallback``: a group is never trained on invented scores.
Valid judgements are cached on disk, keyed by the judge model and the full prompt (so by the
content and the rubric): asking again costs no call.

Compared with OpenPipe ART's ``ruler`` this clamps scores, matches them by id, retries, caches,
and judges trajectories with several histories.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar, Unpack, get_args

from journeyman.errors import ConfigError, InvalidDataError, JudgeError
from journeyman.judge import Judge, JudgeCallError
from journeyman.messages import Item, Tool
from journeyman.trajectory import History, Trajectory, TrajectoryGroup

__all__ = [
    "DEFAULT_PAIRWISE_RUBRIC",
    "DEFAULT_RUBRIC",
    "DEFAULT_VERDICT_RUBRIC",
    "Judgement",
    "Method",
    "RewardFrom",
    "Score",
    "judge_trajectories",
    "judged_rewards",
    "ruler",
    "ruler_score_group",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_RUBRIC = """\
- A trajectory that achieves the goal must score clearly higher than any that does not.
- Among trajectories that achieve it, the more efficient one (fewer wasted steps, tool calls or words) scores higher.
- Make score gaps match quality gaps: nearly equal trajectories get nearly equal scores, a much better one a much higher score.
- Give partial credit for real progress toward the goal."""

_SYSTEM = """\
You judge the work of an AI agent. Every trajectory below is an attempt at the same task; infer the \
task and what success means from the conversation. In a transcript, <call> holds a tool call the \
agent made and <tool> the result it got back. Give each trajectory a score between 0 and 1. \
The scores are compared with each other, so they must rank the trajectories and be spread according \
to how much they differ in quality.

Grading standards:
{rubric}

Reply with one JSON object that has one key per trajectory id, each mapping to \
{{"explanation": "<one or two sentences>", "score": <a number from 0 to 1>}}. \
Use every id exactly once and no other keys."""

DEFAULT_VERDICT_RUBRIC = """\
- The agent achieved the goal only if its final answer does what the user asked, correctly and completely.
- An attempt that ends without a final answer, or whose answer is wrong, did not achieve it."""

_VERDICT_SYSTEM = """\
You check the work of an AI agent. Below is one attempt at a task; infer the task and what success \
means from the conversation. In the transcript, <call> holds a tool call the agent made and <tool> \
the result it got back.

Standards:
{rubric}

{answer}"""

_VERDICT_ANSWER = "Answer with one word: yes if the agent achieved the goal, no if it did not."
_VERDICT_QUESTION = "Did the agent achieve the goal? Answer yes or no."
_CRITERION_ANSWER = "Answer the question after the attempt with one word: yes or no."

DEFAULT_PAIRWISE_RUBRIC = """\
- An attempt whose final answer does what the user asked, correctly and completely, is better than one that does not.
- Between two attempts that both succeed or both fail, the one with fewer wasted steps, tool calls or words is better."""

_PAIRWISE_SYSTEM = """\
You compare two attempts by an AI agent at the same task; infer the task and what success means \
from the conversation. In a transcript, <call> holds a tool call the agent made and <tool> the \
result it got back.

Standards:
{rubric}

Answer with one letter: A if attempt A is better, B if attempt B is better."""

_PAIRWISE_QUESTION = "Which attempt is better? Answer A or B."

_REFERENCE_SYSTEM = """\
You will judge attempts by an AI agent at the task below. Before you see them, say how the task \
should be done: which tools to call with which arguments, and what the final answer must state. \
Be brief: one or two sentences. Do not work out what a tool would return."""

_REFERENCE_QUESTION = "How should the agent do this task?"
_REFERENCE_TOKENS = 64
"""The longest reference: at ~5 tokens/s (the 1.5B on 2 cores) a longer one costs more than the judging."""

Method = Literal["scores", "verdict", "pairwise"]
"""How the judge scores: ``scores`` (RULER: the whole group in one prompt, a JSON object of scores
written out), ``verdict`` (each trajectory alone, its score the probability of "yes" as the first
token: one prompt pass each, no decoding, the shared start of the prompts in vLLM's prefix cache;
with ``criteria``, one yes/no question each after the same attempt, the score their product)
or ``pairwise`` (every pair of distinct trajectories in both orders, P(A) against P(B) of the
first token; a trajectory's score is its mean chance of beating each other one: n(n-1) prompt
passes for n trajectories)."""

RewardFrom = Literal["score", "rank", "best"]
"""What :func:`ruler_score_group` makes a reward of: the judge's ``score``; the trajectory's
``rank`` in the group by score, from 0 (lowest) to 1 (highest), equal scores sharing their mean
rank; or ``best``: 1 for the trajectories with the group's highest score (all of them when they
tie), 0 for the others.

GRPO only compares attempts within a group, and a small judge orders attempts better than it spaces
them. The 1.5B verdict judge gave a sum answered with ``multiply`` P(yes) 0.95 beside ``add``'s 0.96
and a made-up answer's 0.14: its scores leave an attempt with the wrong operation near the group's
mean, so a policy that calls ``multiply`` for everything is rewarded for it on products and barely
penalised on sums, and the demo's judged runs collapsed to it. Ranks spread the near-ties but still
leave the wrong operation above other failures; ``best`` treats every attempt short of the best as
a failure, as a programmatic check does (bench/results.md)."""

_METHODS = get_args(Method)
_REWARD_FROM = get_args(RewardFrom)
_RUBRICS = {"scores": DEFAULT_RUBRIC, "verdict": DEFAULT_VERDICT_RUBRIC, "pairwise": DEFAULT_PAIRWISE_RUBRIC}

_CACHE_VERSION = 1
_ENTRY_TOKENS = 48
"""Tokens for one schema entry besides its explanation: id, keys, score, punctuation, some spaces."""

TrajectoryLike = Trajectory | History | Sequence[Item | dict[str, Any]]
"""What :func:`ruler` judges: a trajectory (all its histories), a history, or a list of messages."""


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

    @property
    def clamped(self) -> int:
        """How many scores fell outside [0, 1] and were clamped."""
        return sum(score.clamped for score in self.scores)


@dataclass(frozen=True)
class _Conversation:
    """A history as the judge sees it."""

    name: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class _InvalidAnswer(ValueError):
    """The judge answered, but not with one valid score per id."""


class JudgeOptions(TypedDict, total=False):
    """How :func:`judge_trajectories` judges (its arguments, each with its default there)."""

    rubric: str | None
    tools: Sequence[Tool | dict[str, Any]] | None
    method: Method
    criteria: Sequence[str] | None
    reference: bool


async def ruler(
    trajectories: Sequence[TrajectoryLike], *, judge: Judge, **options: Unpack[JudgeOptions]
) -> list[Score]:
    """Score trajectories of the same task side by side; one :class:`Score` each, in order.

    ``tools`` are the schemas the agent had, for trajectories given as message lists (a
    :class:`Trajectory` carries its own). ``rubric`` defaults to the method's own
    (:data:`DEFAULT_RUBRIC`, :data:`DEFAULT_VERDICT_RUBRIC`). ``criteria`` (verdicts only) are
    yes/no questions asked of each trajectory one by one instead of whether it achieved the goal
    ("Did it call the tool the request asks for?"); its score is the product of their P(yes).
    ``reference``: before it sees an attempt, the judge writes how the task should be done (one
    short answer per call, from the tools, the system prompt and the request), and every prompt
    shows it as a ``<reference>`` to check the attempts against: reference-guided judging, which
    helps a judge that can solve the task asked plainly but misses mistakes inside a transcript.
    Raises :class:`JudgeError` when the judge gives no valid scores after its retries.
    """
    judgement = await judge_trajectories(trajectories, judge=judge, **options)
    return judgement.scores


async def ruler_score_group(
    group: TrajectoryGroup,
    *,
    judge: Judge,
    rubric: str | None = None,
    judge_weight: float = 1.0,
    reward_weight: float = 0.0,
    fallback: float | None = None,
    method: Method = "scores",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
    reward_from: RewardFrom = "score",
) -> TrajectoryGroup:
    """A copy of ``group`` with each trajectory's reward set from the judge's score.

    ``reward = judge_weight * score + reward_weight * programmatic reward``, where the
    programmatic reward is the one the trajectory had before (kept in
    ``metrics["programmatic_reward"]``). The score goes to ``metrics["ruler_score"]``, the
    explanation to ``logs``, and the judging's counts to the group's ``metrics["judge/..."]``.

    ``reward_from`` is what the judge's part of the reward is made of (:data:`RewardFrom`): its
    score, the trajectory's rank in the group, or whether it is among the group's best (the rank or
    the 0/1 in ``metrics["ruler_rank"]`` or ``metrics["ruler_best"]``).

    If judging fails, the error is recorded on the group (stage ``"judge"``) and each reward
    becomes ``None`` (the trainer leaves the group out and counts it), or, with ``fallback``, is
    computed from that score instead of the judge's. ``method``, ``rubric``, ``criteria`` and
    ``reference`` are :func:`ruler`'s (the reference goes to the group's ``logs``). Usable as ``gather_trajectory_groups(after_each=...)``.
    """
    if judge_weight < 0 or reward_weight < 0 or judge_weight + reward_weight == 0:
        raise ConfigError(
            f"judge_weight and reward_weight must be >= 0 and not both 0; got {judge_weight} and {reward_weight}"
        )
    if reward_from not in _REWARD_FROM:
        raise ConfigError(f"reward_from must be 'score', 'rank' or 'best', got {reward_from!r}")
    if fallback is not None and not 0 <= fallback <= 1:
        raise ConfigError(f"fallback must be a score in [0, 1] or None, got {fallback}")
    scored = group.model_copy(deep=True)
    if not scored.trajectories:
        return scored
    for trajectory in scored:
        if trajectory.reward is not None and "ruler_score" not in trajectory.metrics:
            trajectory.metrics["programmatic_reward"] = trajectory.reward

    def combine(trajectory: Trajectory, score: float) -> float | None:
        if not reward_weight:
            return judge_weight * score
        programmatic = trajectory.metrics.get("programmatic_reward")
        return None if programmatic is None else judge_weight * score + reward_weight * float(programmatic)

    start = time.perf_counter()
    try:
        if reward_weight:
            missing = [t.id for t in scored if "programmatic_reward" not in t.metrics]
            if missing:
                raise InvalidDataError(
                    f"reward_weight={reward_weight} adds each trajectory's own reward to the judge's score, but "
                    f"{len(missing)} of {len(scored)} have none ({', '.join(missing[:3])}): set the reward in "
                    "the rollout, or use reward_weight=0"
                )
        judgement = await judge_trajectories(
            scored.trajectories, judge=judge, rubric=rubric, method=method, criteria=criteria,
            reference=reference,
        )  # fmt: skip
    except Exception as error:
        failure = scored.record_failure(error, stage="judge")
        scored.metrics.update({"judge/failed": 1, "judge/seconds": time.perf_counter() - start})
        if fallback is None:
            outcome = "left without rewards (not trained on)"
        else:
            outcome = f"given the fallback score {fallback}"
        scored.logs.append(
            f"judge {judge.name} failed ({failure.type}: {failure.message}); trajectories {outcome}"
        )
        logger.warning(
            "judging group %s failed (%s: %s); %s", scored.id, failure.type, failure.message, outcome
        )
        for trajectory in scored:
            if fallback is None:
                trajectory.reward = None
            else:
                trajectory.metrics["judge_fallback"] = True
                trajectory.reward = combine(trajectory, fallback)
            trajectory.log(f"RULER: judge failed ({failure.type}); {outcome}")
        return scored

    made = judged_rewards([score.score for score in judgement.scores], reward_from)
    for trajectory, score, value in zip(scored, judgement.scores, made, strict=True):
        trajectory.metrics["ruler_score"] = score.score
        if reward_from != "score":
            trajectory.metrics[f"ruler_{reward_from}"] = value
        note = ""
        if score.clamped:
            trajectory.metrics["ruler_score_clamped"] = True
            note = f" (clamped from {score.raw_score:g})"
        trajectory.reward = combine(trajectory, value)
        made_of = f", {reward_from} {value:.3f}" if reward_from != "score" else ""
        trajectory.log(
            f"RULER ({judgement.judge}) score {score.score:.3f}{note}{made_of}: {score.explanation}"
        )
        trajectory.metadata["judge_explanation"] = score.explanation  # the Langfuse score's comment
    for reason in judgement.retries:
        scored.logs.append(f"judge retry: {reason}")
    if judgement.reference is not None:
        scored.logs.append(f"judge reference: {judgement.reference}")
    if judgement.distinct == 1 and len(scored) > 1:
        scored.logs.append(
            f"all {len(scored)} trajectories are identical: judged once, the score copied to each"
        )
    scored.metrics.update(
        {
            "judge/failed": 0,
            "judge/attempts": judgement.attempts,
            "judge/retries": len(judgement.retries),
            "judge/clamped": judgement.clamped,
            "judge/cached": judgement.cached,
            "judge/distinct": judgement.distinct,
            "judge/seconds": time.perf_counter() - start,
        }
    )
    return scored


def _ranks(scores: list[float]) -> list[float]:
    """Each score's rank among ``scores``, 0 for the lowest and 1 for the highest, equal scores
    sharing their mean rank; 0.5 for a single score."""
    if len(scores) < 2:
        return [0.5] * len(scores)
    below = [sum(other < score for other in scores) + (scores.count(score) - 1) / 2 for score in scores]
    return [place / (len(scores) - 1) for place in below]


def judged_rewards(scores: Sequence[float], reward_from: RewardFrom = "score") -> list[float]:
    """The rewards ``scores`` of one group make (:data:`RewardFrom`)."""
    if reward_from == "rank":
        return _ranks(list(scores))
    if reward_from == "best":
        top = max(scores, default=0.0)
        return [float(score == top) for score in scores]
    return list(scores)


async def judge_trajectories(
    trajectories: Sequence[TrajectoryLike],
    *,
    judge: Judge,
    rubric: str | None = None,
    tools: Sequence[Tool | dict[str, Any]] | None = None,
    method: Method = "scores",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
) -> Judgement:
    """:func:`ruler` with the details: attempts, retries, cache hits, distinct trajectories."""
    if method not in _METHODS:
        raise ConfigError(f"method must be 'scores', 'verdict' or 'pairwise', got {method!r}")
    _check_criteria(criteria, method)
    if not trajectories:
        return Judgement(scores=[], judge=judge.name, distinct=0)
    if rubric is None:
        rubric = _RUBRICS[method]
    tool_dicts = [_tool_dict(tool) for tool in tools] if tools is not None else None
    conversations = [_conversations(item, tool_dicts) for item in trajectories]
    keys = [  # what the judge would read: trajectories that differ only in call ids are one
        json.dumps([[c.name, _transcript(c.messages, {}), c.tools] for c in convs], sort_keys=True)
        for convs in conversations
    ]
    labels: dict[str, str] = {}  # content -> the id the judge sees; identical trajectories share one
    for key in keys:
        labels.setdefault(key, str(len(labels) + 1))
    ids = list(labels.values())
    unique = [conversations[keys.index(key)] for key in labels]
    judgement = Judgement(scores=[], judge=judge.name, distinct=len(unique))
    if reference:
        judgement.reference = await _reference(judge, unique, judgement)
    if method == "verdict":
        by_id = await _verdicts(judge, unique, ids, rubric, judgement, criteria)
    elif method == "pairwise":
        by_id = await _pairwise(judge, unique, ids, rubric, judgement)
    else:
        messages = _prompt(unique, ids, rubric, judgement.reference)
        path = _cache_path(judge, messages)
        cached = _read_cache(path, ids) if path is not None else None
        if cached is not None:
            by_id, judgement.cached = cached, True
        else:
            by_id = await _ask(judge, messages, ids, judgement)
            if path is not None:
                _write_cache(path, by_id)
    judgement.scores = [by_id[labels[key]] for key in keys]
    return judgement


def _check_criteria(criteria: Sequence[str] | None, method: Method) -> None:
    if criteria is None:
        return
    if isinstance(criteria, str):
        raise ConfigError(f"criteria must be a list of yes/no questions, got one string: [{criteria!r}]?")
    if method != "verdict":
        raise ConfigError(
            f"criteria are asked one by one as yes/no questions, which needs method='verdict' (got {method!r}); "
            "for scores or pairwise, put them in the rubric"
        )
    if not criteria or not all(isinstance(c, str) and c.strip() for c in criteria):
        raise ConfigError(f"criteria must be non-empty questions, at least one, got {list(criteria)!r}")


async def _retrying(judge: Judge, judgement: Judgement, call: Callable[[], Awaitable[_T]], failed: str) -> _T:
    """``call()`` until it succeeds, at most ``1 + judge.max_retries`` times, waiting
    ``judge.retry_delay`` (doubled each time) between tries; each failure goes to
    ``judgement.retries``. Then :class:`JudgeError`: ``failed``, formatted with ``attempts``, and why."""
    attempts = 1 + judge.max_retries
    reasons = []
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except (JudgeCallError, _InvalidAnswer) as error:
            reasons.append(f"attempt {attempt}: {error}")
            judgement.retries.append(reasons[-1])
            logger.warning("judge %r, attempt %d of %d: %s", judge.name, attempt, attempts, error)
            if attempt < attempts:
                await asyncio.sleep(judge.retry_delay * 2 ** (attempt - 1))
    raise JudgeError(failed.format(attempts=attempts, reasons="; ".join(reasons)))


async def _ask(
    judge: Judge, messages: list[dict[str, str]], ids: list[str], judgement: Judgement
) -> dict[str, Score]:
    """Ask until the answer holds one valid score per id, at most ``1 + judge.max_retries`` times."""
    schema = _schema(ids, judge.explanation_max_chars)
    max_tokens = None
    if judge.explanation_max_chars is not None:  # each token holds at least one character
        max_tokens = len(ids) * (judge.explanation_max_chars + _ENTRY_TOKENS) + 16

    async def attempt() -> dict[str, Score]:
        judgement.attempts += 1
        bound = max_tokens if judge.uses_schema else None  # a freely written object needs more
        judgement.answer = await judge.complete(messages, schema, max_tokens=bound)
        return _parse(judgement.answer, ids)

    failed = (
        f"judge {judge.name!r} gave no valid scores for {len(ids)} trajectories in {{attempts}} attempts: "
        "{reasons}. Check that the judge model can follow the JSON format, or raise Judge(max_retries=..., "
        "timeout=...)"
    )
    return await _retrying(judge, judgement, attempt, failed)


async def _first_token(
    judge: Judge, messages: list[dict[str, str]], answers: tuple[str, str], judgement: Judgement, what: str
) -> tuple[Score, bool]:
    """P(first answer) / P(either) of the reply's first token, as a :class:`Score`, and whether it
    came from the cache. Retried like any judge call; a judge that puts neither answer among its
    likeliest first tokens does not follow the prompt, and asking again at temperature 0 would not help."""
    path = _cache_path(judge, messages)
    cached = _read_cache(path, ["verdict"]) if path is not None else None
    if cached is not None:
        return cached["verdict"], True

    async def attempt() -> dict[str, float]:
        judgement.attempts += 1
        return await judge.verdict(messages, answers)

    failed = f"judge {judge.name!r} gave no {what} in {{attempts}} attempts: {{reasons}}"
    mass = await _retrying(judge, judgement, attempt, failed)
    first, second = answers
    total = mass[first] + mass[second]
    if total == 0:
        raise JudgeError(
            f"judge {judge.name!r} put neither {first!r} nor {second!r} among its 20 likeliest first tokens: it "
            f"does not follow the {what} prompt; try another judge model or method='scores'"
        )
    p = mass[first] / total
    score = Score(p, f"P({first}) = {p:.3f} ({first} {mass[first]:.3g}, {second} {mass[second]:.3g})", p)
    if path is not None:
        _write_cache(path, {"verdict": score})
    return score, False


async def _verdicts(
    judge: Judge,
    unique: list[list[_Conversation]],
    ids: list[str],
    rubric: str,
    judgement: Judgement,
    criteria: Sequence[str] | None,
) -> dict[str, Score]:
    """Each distinct trajectory judged alone, its score P(yes) / (P(yes) + P(no)); with criteria,
    the product of each criterion's (the chance that it meets them all, were they independent); by id."""
    prompts = _verdict_prompts(unique, rubric, criteria, judgement.reference)
    results = await asyncio.gather(
        *(
            _first_token(judge, m, ("yes", "no"), judgement, "verdict")
            for questions in prompts
            for m in questions
        )
    )
    judgement.cached = all(cached for _, cached in results)
    asked = len(prompts[0])
    scores = {}
    for n, id_ in enumerate(ids):
        answers = [score for score, _ in results[n * asked : (n + 1) * asked]]
        if not criteria:
            scores[id_] = answers[0]
            continue
        p = math.prod(answer.score for answer in answers)
        each = ", ".join(f"{answer.score:.3f}" for answer in answers)
        scores[id_] = Score(p, f"P(yes) for each criterion: {each}; product {p:.3f}", p)
    return scores


async def _reference(judge: Judge, unique: list[list[_Conversation]], judgement: Judgement) -> str:
    """How the task should be done, in the judge's words, asked once for the group: the tools, the
    system prompt and the last request before the attempts (not the whole shared start, whose
    worked examples would cost a small judge seconds to read and tell it nothing new)."""
    messages = unique[0][0].messages
    shared = _shared_start(unique)
    first = next((n for n, m in enumerate(messages) if n >= shared and m["role"] == "assistant"), None)
    before = messages[:first] if shared and first is not None else messages
    request = next((m for m in reversed(before) if m["role"] == "user"), None)
    task = [m for m in before if m["role"] == "system"] + ([request] if request is not None else [])
    parts = []
    tools = unique[0][0].tools
    if tools:
        parts.append(f"<available_tools>\n{_tool_lines(tools)}\n</available_tools>")
    parts += [f"<task>\n{_transcript(task, {})}\n</task>", _REFERENCE_QUESTION]
    prompt = [
        {"role": "system", "content": _REFERENCE_SYSTEM},
        {"role": "user", "content": "\n".join(parts)},
    ]
    path = _cache_path(judge, prompt)
    cached = _read_cache(path, ["reference"]) if path is not None else None
    if cached is not None:
        return cached["reference"].explanation

    async def attempt() -> str:
        judgement.attempts += 1
        text = (await judge.complete(prompt, max_tokens=_REFERENCE_TOKENS)).strip()
        if not text:
            raise _InvalidAnswer("an empty reference")
        return text

    failed = f"judge {judge.name!r} wrote no reference in {{attempts}} attempts: {{reasons}}"
    text = await _retrying(judge, judgement, attempt, failed)
    if path is not None:  # stored as a score's explanation: one cache format for every judge call
        _write_cache(path, {"reference": Score(0.0, text, 0.0)})
    return text


async def _pairwise(
    judge: Judge, unique: list[list[_Conversation]], ids: list[str], rubric: str, judgement: Judgement
) -> dict[str, Score]:
    """Every ordered pair of distinct trajectories; a trajectory's score is its mean chance of
    winning, each pair's chance the mean of its two orders (so the order shown cancels out)."""
    n = len(unique)
    if n == 1:
        return {ids[0]: Score(0.5, "the only distinct attempt: nothing to compare it with", 0.5)}
    shared, tools_shared, head = _layout(unique, judgement.reference)
    bodies = [_body(conversations, shared, tools_shared) for conversations in unique]
    system = {"role": "system", "content": _PAIRWISE_SYSTEM.format(rubric=rubric.strip())}
    orders = [(i, j) for i in range(n) for j in range(n) if i != j]
    prompts = [
        [system, {"role": "user", "content": "\n".join(
            [*head, f"<attempt id=\"A\">\n{bodies[i]}\n</attempt>", f"<attempt id=\"B\">\n{bodies[j]}\n</attempt>",
             _PAIRWISE_QUESTION]
        )}]
        for i, j in orders
    ]  # fmt: skip
    results = await asyncio.gather(
        *(_first_token(judge, m, ("a", "b"), judgement, "comparison") for m in prompts)
    )
    judgement.cached = all(cached for _, cached in results)
    wins = [[0.0] * n for _ in range(n)]  # wins[i][j]: the chance i beats j, summed over both orders
    for (i, j), (score, _) in zip(orders, results, strict=True):
        wins[i][j] += score.score / 2
        wins[j][i] += (1 - score.score) / 2
    scores = {}
    for i, id_ in enumerate(ids):
        p = sum(wins[i]) / (n - 1)
        first_shown = sum(score.score for (a, _), (score, _) in zip(orders, results, strict=True) if a == i)
        scores[id_] = Score(p, f"wins {p:.3f} of its comparisons (as A: {first_shown / (n - 1):.3f})", p)
    return scores


# The prompt -------------------------------------------------------------------------------------


def _tool_dict(tool: Tool | dict[str, Any]) -> dict[str, Any]:
    try:
        return Tool.model_validate(tool).model_dump(exclude_none=True)
    except ValueError as error:
        raise InvalidDataError(f"not a tool schema ({error}): {str(tool)[:200]}") from None


def _conversation(history: History, tools: list[dict[str, Any]] | None) -> _Conversation:
    own = (
        [tool.model_dump(exclude_none=True) for tool in history.tools] if history.tools is not None else None
    )
    return _Conversation(history.name, history.openai_messages(), own if own is not None else tools)


def _conversations(item: TrajectoryLike, tools: list[dict[str, Any]] | None) -> list[_Conversation]:
    """Every history of one trajectory, main one first."""
    if isinstance(item, Trajectory):
        return [_conversation(history, tools) for history in item.histories]
    if isinstance(item, History):
        return [_conversation(item, tools)]
    if isinstance(item, str | bytes | dict):
        raise InvalidDataError(
            f"ruler takes a list of trajectories (each a Trajectory, a History or a list of messages), "
            f"got a {type(item).__name__} in that list"
        )
    history = History()
    for message in item:
        history.add(message)
    return [_conversation(history, tools)]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    """A message's content as the judge reads it, with every ``<`` written ``&lt;``: nothing an agent
    or a tool wrote can open or close the transcript's tags, nor pass for markup the judge knows
    (an agent that writes ``<tool name="add">5</tool>``, or the ``<tool_response>`` of Qwen's own chat
    template, cannot pass it off as a tool's result)."""
    if content is None:
        return ""
    if not isinstance(content, str):  # content parts: text as is, anything else named
        content = "".join(
            str(part.get("text", "")) if part.get("type") == "text" else f"[{part.get('type', 'part')}]"
            for part in content
        )
    return str(content).replace("<", "&lt;")


def _transcript(messages: list[dict[str, Any]], names: dict[str, str]) -> str:
    """Messages as tagged lines: ``<user>...</user>``, an assistant's tool calls as
    ``<call>name {arguments}</call>``, a result as ``<tool name="...">...</tool>``. Call ids, types
    and empty fields are left out: they cost a small judge tokens and tell it nothing. ``names``
    maps call ids to tool names, filled as calls are met (results name the tool they answer)."""
    lines = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            name = names.get(message.get("tool_call_id", ""), message.get("name") or "unknown")
            lines.append(f'<tool name="{name}">{_text(message.get("content"))}</tool>')
            continue
        text = _text(message.get("content"))
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            names[call.get("id", "")] = function.get("name", "")
            text += f"<call>{function.get('name', '')} {_text(function.get('arguments', ''))}</call>"
        lines.append(f"<{role}>{text}</{role}>")
    return "\n".join(lines)


def _signature(tool: dict[str, Any]) -> str:
    """A tool as one line: ``name(a: integer, b: integer): description``."""
    function = tool.get("function", {})
    parameters = function.get("parameters") or {}
    required = set(parameters.get("required") or [])
    arguments = ", ".join(
        f"{key}{'' if key in required else '?'}: {spec.get('type', 'any') if isinstance(spec, dict) else 'any'}"
        for key, spec in (parameters.get("properties") or {}).items()
    )
    description = f": {function['description']}" if function.get("description") else ""
    return f"- {function.get('name', '')}({arguments}){description}"


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(_signature(tool) for tool in tools)


def _shared_prefix(lists: list[list[dict[str, Any]]]) -> int:
    """How many leading messages every list has in common."""
    shared = 0
    for column in zip(*lists, strict=False):
        if any(message != column[0] for message in column[1:]):
            break
        shared += 1
    return shared


def _shared_start(unique: list[list[_Conversation]]) -> int:
    """How many leading messages every trajectory's main history shares (0 for one trajectory:
    nothing tells its start from its attempt)."""
    return _shared_prefix([conversations[0].messages for conversations in unique]) if len(unique) > 1 else 0


def _layout(unique: list[list[_Conversation]], reference: str | None = None) -> tuple[int, bool, list[str]]:
    """What every trajectory shares: the number of leading messages, whether the tools, and the
    parts that show them once (``<available_tools>``, then ``<context>``: the tools first, so
    that prompts for groups with other questions still share them in a prefix cache; then the
    judge's ``<reference>``)."""
    mains = [conversations[0].messages for conversations in unique]
    shared = _shared_start(unique)
    tool_lists = [c.tools for conversations in unique for c in conversations]
    tools_shared = all(tools == tool_lists[0] for tools in tool_lists)
    head = []
    if tools_shared and tool_lists[0]:
        head.append(f"<available_tools>\n{_tool_lines(tool_lists[0])}\n</available_tools>")
    if shared:
        head.append(f"<context>\n{_transcript(mains[0][:shared], {})}\n</context>")
    if reference is not None:
        head.append(_reference_block(reference))
    return shared, tools_shared, head


def _reference_block(reference: str) -> str:
    return (
        "<reference>(how the task should be done, written by the judge before it saw an attempt; it may "
        f"be wrong)\n{_text(reference)}\n</reference>"
    )


def _body(conversations: list[_Conversation], shared: int, tools_shared: bool) -> str:
    """One trajectory's histories, less what every trajectory shares."""
    body = []
    for k, conversation in enumerate(conversations):
        names: dict[str, str] = {}
        if k == 0 and shared:  # results in the trajectory can answer calls made in the shared start
            _transcript(conversation.messages[:shared], names)
        text = _transcript(conversation.messages[shared:] if k == 0 else conversation.messages, names)
        if not tools_shared and conversation.tools:
            text = f"<tools>\n{_tool_lines(conversation.tools)}\n</tools>\n{text}"
        if len(conversations) > 1:
            name = conversation.name or ("main" if k == 0 else f"history {k}")
            text = f'<history name="{name}">\n{text}\n</history>'
        body.append(text)
    return "\n".join(body)


def _outcome(conversations: list[_Conversation], shared: int) -> str | None:
    """What an attempt came to, in lines a small judge cannot miss: the user's request it answers,
    each tool call it made with its arguments and result (in every history, after the shared start),
    and its final message. A result the agent made up in its own words is then plainly not a tool's,
    and a call that does not fit the request sits next to it. None for an attempt with no tools and
    no tool results (saying "none" would read as a failure).

    Measured on the demo's groups (the 1.5B, verdicts, the demo's rubric): with the tool results and the final message,
    P(yes) for answers written after a fake ``<tool_response>`` fell from 0.78 to 0.48 on average;
    with the request and the calls' arguments as well, the pairs it ranked right in groups where the
    policy called multiply for sums rose from 65% to 75%."""
    calls: dict[str, str] = {}
    results = []
    for k, conversation in enumerate(conversations):
        for n, message in enumerate(conversation.messages):
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                calls[call.get("id", "")] = (
                    f"{function.get('name', '')} {_text(function.get('arguments', ''))}"
                )
            if message["role"] == "tool" and (k > 0 or n >= shared):
                call = calls.get(message.get("tool_call_id", ""), message.get("name") or "unknown")
                results.append(f"{call} -> {_text(message.get('content')).strip()}")
    if not results and not any(c.tools for c in conversations):
        return None
    messages = conversations[0].messages
    first = next(
        (n for n, m in enumerate(messages) if n >= shared and m["role"] == "assistant"), len(messages)
    )
    asked = next(
        (_text(m.get("content")).strip() for m in reversed(messages[:first]) if m["role"] == "user"), ""
    )
    final = next(
        (m for m in reversed(messages[shared:]) if m["role"] == "assistant" and not m.get("tool_calls")), None
    )
    said = _text(final.get("content")).strip() if final is not None else ""
    return (
        f"<outcome>\nThe user asked: {asked or 'nothing'}\n"
        f"Tool calls and their results: {'; '.join(results) or 'none (it got no tool result)'}\n"
        f"Its final message: {said or 'none'}\n</outcome>"
    )


def _prompt(
    unique: list[list[_Conversation]], ids: list[str], rubric: str, reference: str | None = None
) -> list[dict[str, str]]:
    shared, tools_shared, parts = _layout(unique, reference)
    parts.append("Trajectories:")
    for id_, conversations in zip(ids, unique, strict=True):
        parts.append(f'<trajectory id="{id_}">\n{_body(conversations, shared, tools_shared)}\n</trajectory>')
    return [
        {"role": "system", "content": _SYSTEM.format(rubric=rubric.strip())},
        {"role": "user", "content": "\n".join(parts)},
    ]


def _verdict_prompts(
    unique: list[list[_Conversation]],
    rubric: str,
    criteria: Sequence[str] | None,
    reference: str | None = None,
) -> list[list[list[dict[str, str]]]]:
    """For each trajectory, one prompt per question (whether it achieved the goal, or each
    criterion), all starting alike (system, shared context, tools) and each trajectory's alike up to
    its question, so a server with prefix caching reads that start once and each trajectory once.
    The judge's reference comes after the attempt's outcome, next to the question."""
    shared, tools_shared, head = _layout(unique)
    answer = _CRITERION_ANSWER if criteria else _VERDICT_ANSWER
    system = {"role": "system", "content": _VERDICT_SYSTEM.format(rubric=rubric.strip(), answer=answer)}
    questions = [f"{c.strip()} Answer yes or no." for c in criteria] if criteria else [_VERDICT_QUESTION]
    prompts = []
    for conversations in unique:
        parts = [*head, f"<trajectory>\n{_body(conversations, shared, tools_shared)}\n</trajectory>"]
        outcome = _outcome(conversations, shared)
        if outcome is not None:
            parts.append(outcome)
        if reference is not None:
            parts.append(_reference_block(reference))
        attempt = "\n".join(parts)
        prompts.append([[system, {"role": "user", "content": f"{attempt}\n{q}"}] for q in questions])
    return prompts


def _schema(ids: list[str], explanation_max_chars: int | None) -> dict[str, Any]:
    """One required key per id: a constrained decoder cannot skip, repeat or invent one."""
    explanation: dict[str, Any] = {"type": "string"}
    if explanation_max_chars is not None:
        explanation["maxLength"] = explanation_max_chars
    entry = {
        "type": "object",
        "properties": {"explanation": explanation, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {id_: entry for id_ in ids},
        "required": ids,
        "additionalProperties": False,
    }


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
    raise _InvalidAnswer(f"no JSON object with scores in the answer{why}: {text[:200]!r}")


def _number(value: Any, id_: str) -> float:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _InvalidAnswer(f"the score of trajectory {id_} is not a finite number: {value!r}")
    return float(value)


def _parse(text: str, ids: list[str]) -> dict[str, Score]:
    """One :class:`Score` per id, matched by id; :class:`_InvalidAnswer` if the answer is not that."""
    data = _scores_object(text, ids)
    entries: dict[str, Any] = {}
    if isinstance(data.get("scores"), list):  # the list form: {"scores": [{"trajectory_id", "score", ...}]}
        for entry in data["scores"]:
            if not isinstance(entry, dict):
                raise _InvalidAnswer(f"a score entry is not an object: {entry!r}")
            id_ = str(entry.get("trajectory_id", entry.get("id")))
            if id_ in entries:
                raise _InvalidAnswer(f"trajectory {id_} was scored twice")
            entries[id_] = entry
    else:
        entries = data
    missing = [id_ for id_ in ids if id_ not in entries]
    extra = [id_ for id_ in entries if id_ not in ids]
    if missing or extra:
        raise _InvalidAnswer(f"the answer must score ids {ids} once each; missing {missing}, unknown {extra}")
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


def _cache_path(judge: Judge, messages: list[dict[str, str]]) -> Path | None:
    if judge.cache_dir is None:
        return None
    key = json.dumps({"version": _CACHE_VERSION, "judge": judge.name, "messages": messages}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()
    return judge.cache_dir / digest[:2] / f"{digest}.json"


def _read_cache(path: Path, ids: list[str]) -> dict[str, Score] | None:
    try:
        data = json.loads(path.read_text())
        return {id_: Score(**data[id_]) for id_ in ids}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring unreadable judge cache entry %s (%s); judging again", path, error)
        return None


def _write_cache(path: Path, scores: dict[str, Score]) -> None:
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
