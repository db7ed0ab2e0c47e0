"""Judging a group: an LLM judge scores the attempts of one group, and their rewards are made from
the scores. Import these from :mod:`journeyman.judge`.

GRPO needs only relative rewards within a group, and a judge orders several attempts at the same
task more reliably than it scores one attempt alone. So a task with no programmatic success
check can still be trained on::

    from journeyman.judge import Judge, judge_group

    judge = Judge(model="base", base_url=f"{gateway_url}/v1")
    groups = await jm.gather_trajectory_groups(
        (jm.TrajectoryGroup(rollout(s) for _ in range(4)) for s in scenarios),
        after_each=lambda group: judge_group(group, judge=judge),
    )

What the judge sees: the tools, one line each, once when all histories share them (else with each
history); the messages every trajectory starts with, once, as ``<context>``; then each distinct
trajectory under an id, with every history it holds. Messages read as a tagged transcript
(``<user>``, ``<assistant>``, ``<call>add {"a": 2, "b": 3}</call>``, ``<tool name="add">5</tool>``),
not as API JSON: call ids and empty fields tell a judge nothing and cost a small one a third of
what it reads. Trajectories that read the same are judged once and share the score.

What is checked: a verdict is read from the logprobs of the reply's first token; group scores are a
JSON schema-constrained object where the endpoint supports it, else found in free text. Scores are
matched to trajectories by id, never by position; a score outside [0, 1] is clamped and counted.
Malformed JSON, a missing, extra or repeated id, a timeout or an HTTP 5xx is answered by asking
again, up to ``judge.max_retries`` times; then :class:`~journeyman.errors.JudgeError`.
:func:`judge_group` records that error on the group as a :class:`~journeyman.trajectory.Failure`
and leaves the trajectories without a reward (the trainer skips them), or gives them ``fallback``:
a group is never trained on invented scores. Valid judgements are cached on disk, keyed by the
judge model and the full prompt (so by the content and the rubric): asking again costs no call.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack, get_args

from journeyman._deprecated import callable_module, warn
from journeyman.errors import ConfigError, InvalidDataError, JudgeError
from journeyman.judge_calls import ask_pairwise, ask_reference, ask_scores, ask_verdicts
from journeyman.judge_client import Judge
from journeyman.judge_prompts import (
    DEFAULT_PAIRWISE_RUBRIC,
    DEFAULT_RUBRIC,
    DEFAULT_VERDICT_RUBRIC,
    RUBRICS,
    TrajectoryLike,
    conversations_of,
    scores_prompt,
    tool_dict,
    transcript_of,
)
from journeyman.judgements import Judgement, Score, cache_path, read_cache, write_cache
from journeyman.messages import Tool
from journeyman.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "DEFAULT_PAIRWISE_RUBRIC",
    "DEFAULT_RUBRIC",
    "DEFAULT_VERDICT_RUBRIC",
    "JudgeOptions",
    "Judgement",
    "Method",
    "RewardFrom",
    "Score",
    "judge_group",
    "judge_trajectories",
    "judged_rewards",
    "method_for",
    "score_trajectories",
]

logger = logging.getLogger(__name__)

Method = Literal["auto", "scores", "verdict", "pairwise"]
"""How the judge scores: ``auto`` (the default: ``verdict`` where the judge returns the logprobs it
reads, else ``scores``; a judge whose first verdict comes back without logprobs is asked for
scores from then on), ``scores`` (RULER: the whole group in one prompt, a JSON object of scores
written out), ``verdict`` (each trajectory alone, its score the probability of "yes" as the first
token: one prompt pass each, no decoding, the shared start of the prompts in vLLM's prefix cache;
with ``criteria``, one yes/no question each after the same attempt, the score their product)
or ``pairwise`` (every pair of distinct trajectories in both orders, P(A) against P(B) of the
first token; a trajectory's score is its mean chance of beating each other one: n(n-1) prompt
passes for n trajectories)."""

RewardFrom = Literal["score", "rank", "best"]
"""What :func:`judge_group` makes a reward of: the judge's ``score``; the trajectory's
``rank`` in the group by score, from 0 (lowest) to 1 (highest), equal scores sharing their mean
rank; or ``best``: 1 for the trajectories with the group's highest score (all of them when they
tie), 0 for the others.

GRPO only compares attempts within a group, and a small judge orders attempts better than it spaces
them: its scores can leave an attempt with the wrong operation (a sum answered with ``multiply``)
close to the right one and far above a made-up answer, so near the group's mean. A policy that
calls ``multiply`` for everything is then rewarded for it on products and barely penalised on sums,
and training can collapse to it. Ranks spread the near-ties but still leave the wrong operation
above other failures; ``best`` treats every attempt short of the best as a failure, as a
programmatic check does (chosen by measurement; see docs/results/)."""

_METHODS = get_args(Method)
_REWARD_FROM = get_args(RewardFrom)


class JudgeOptions(TypedDict, total=False):
    """How :func:`judge_trajectories` judges (its arguments, each with its default there)."""

    rubric: str | None
    tools: Sequence[Tool | dict[str, Any]] | None
    method: Method
    criteria: Sequence[str] | None
    reference: bool


async def score_trajectories(
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


async def judge_group(
    group: TrajectoryGroup,
    *,
    judge: Judge,
    rubric: str | None = None,
    judge_weight: float = 1.0,
    reward_weight: float = 0.0,
    fallback: float | None = None,
    method: Method = "auto",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
    reward_from: RewardFrom = "best",
) -> TrajectoryGroup:
    """A copy of ``group`` with each trajectory's reward set from the judge's score.

    ``reward = judge_weight * score + reward_weight * programmatic reward``, where the
    programmatic reward is the one the trajectory had before (kept in
    ``metrics["programmatic_reward"]``). The score goes to ``metrics["ruler_score"]``, the
    explanation to ``logs``, and the judging's counts to the group's ``metrics["judge/..."]``.

    ``reward_from`` is what the judge's part of the reward is made of (:data:`RewardFrom`): its
    score, the trajectory's rank in the group, or whether it is among the group's best (the
    default; the rank or the 0/1 in ``metrics["ruler_rank"]`` or ``metrics["ruler_best"]``). The
    defaults, verdicts made into 1 for the group's best, are what taught best with small local
    judges (the judges results page).

    If judging fails, the error is recorded on the group (stage ``"judge"``) and each reward
    becomes ``None`` (the trainer leaves the group out and counts it), or, with ``fallback``, is
    computed from that score instead of the judge's. ``method``, ``rubric``, ``criteria`` and
    ``reference`` are :func:`score_trajectories`' (the reference goes to the group's ``logs``).
    Usable as ``gather_trajectory_groups(after_each=...)``.
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
    weights = _Weights(judge_weight, reward_weight)
    start = time.perf_counter()
    try:
        weights.check(scored)
        judgement = await judge_trajectories(
            scored.trajectories, judge=judge, rubric=rubric, method=method, criteria=criteria,
            reference=reference,
        )  # fmt: skip
    except ConfigError:
        raise  # the call's mistake, the same for every group: not a judging that failed
    except Exception as error:
        _judge_failed(scored, judge, error, weights, fallback)
        scored.metrics["judge/seconds"] = time.perf_counter() - start
        return scored
    _judged(scored, judgement, weights, reward_from)
    scored.metrics["judge/seconds"] = time.perf_counter() - start
    return scored


@dataclass(frozen=True)
class _Weights:
    """reward = judge * (the judge's part) + reward * (the trajectory's programmatic reward)."""

    judge: float
    reward: float

    def check(self, group: TrajectoryGroup) -> None:
        missing = [t.id for t in group if "programmatic_reward" not in t.metrics]
        if self.reward and missing:
            raise InvalidDataError(
                f"reward_weight={self.reward} adds each trajectory's own reward to the judge's score, but "
                f"{len(missing)} of {len(group)} have none ({', '.join(missing[:3])}): set the reward in "
                "the rollout, or use reward_weight=0"
            )

    def reward_of(self, trajectory: Trajectory, judged: float) -> float | None:
        if not self.reward:
            return self.judge * judged
        programmatic = trajectory.metrics.get("programmatic_reward")
        return None if programmatic is None else self.judge * judged + self.reward * float(programmatic)


def _judge_failed(
    scored: TrajectoryGroup, judge: Judge, error: Exception, weights: _Weights, fallback: float | None
) -> None:
    """The failure on the group, and each trajectory left without a reward or given the fallback."""
    failure = scored.record_failure(error, stage="judge")
    scored.metrics["judge/failed"] = 1
    outcome = (
        "left without rewards (not trained on)"
        if fallback is None
        else f"given the fallback score {fallback}"
    )
    scored.logs.append(
        f"judge {judge.name} failed ({failure.type}: {failure.message}); trajectories {outcome}"
    )
    logger.warning("judging group %s failed (%s: %s); %s", scored.id, failure.type, failure.message, outcome)
    for trajectory in scored:
        if fallback is None:
            trajectory.reward = None
        else:
            trajectory.metrics["judge_fallback"] = True
            trajectory.reward = weights.reward_of(trajectory, fallback)
        trajectory.log(f"RULER: judge failed ({failure.type}); {outcome}")


def _judged(
    scored: TrajectoryGroup, judgement: Judgement, weights: _Weights, reward_from: RewardFrom
) -> None:
    """Each trajectory's reward, score and explanation from the judgement; the group's counts."""
    made = judged_rewards([score.score for score in judgement.scores], reward_from)
    for trajectory, score, value in zip(scored, judgement.scores, made, strict=True):
        trajectory.metrics["ruler_score"] = score.score
        if reward_from != "score":
            trajectory.metrics[f"ruler_{reward_from}"] = value
        note = ""
        if score.clamped:
            trajectory.metrics["ruler_score_clamped"] = True
            note = f" (clamped from {score.raw_score:g})"
        trajectory.reward = weights.reward_of(trajectory, value)
        made_of = f", {reward_from} {value:.3f}" if reward_from != "score" else ""
        trajectory.log(
            f"RULER ({judgement.judge}) score {score.score:.3f}{note}{made_of}: {score.explanation}"
        )
        trajectory.metadata["judge_explanation"] = score.explanation  # the Langfuse score's comment
    scored.logs.extend(f"judge retry: {reason}" for reason in judgement.retries)
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
        }
    )


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


def method_for(judge: Judge, method: Method = "auto") -> Method:
    """The method ``method`` means for ``judge``: ``auto`` is ``verdict`` unless the judge is known
    to return no logprobs (a LangChain chat model, or an endpoint whose verdict had none)."""
    if method != "auto":
        return method
    return "scores" if judge.gives_logprobs is False else "verdict"


async def judge_trajectories(
    trajectories: Sequence[TrajectoryLike],
    *,
    judge: Judge,
    rubric: str | None = None,
    tools: Sequence[Tool | dict[str, Any]] | None = None,
    method: Method = "auto",
    criteria: Sequence[str] | None = None,
    reference: bool = False,
) -> Judgement:
    """:func:`score_trajectories` with the details: the method used, attempts, retries, cache hits,
    distinct trajectories."""
    if method not in _METHODS:
        raise ConfigError(f"method must be 'auto', 'scores', 'verdict' or 'pairwise', got {method!r}")
    _check_criteria(criteria, "verdict" if method == "auto" else method)
    if method == "auto":
        if criteria is not None and judge.gives_logprobs is False:
            raise ConfigError(
                f"criteria are asked as yes/no verdicts, and judge {judge.name!r} returns no logprobs to read "
                "them from: put them in the rubric instead"
            )
        method = method_for(judge)
        if method == "verdict":  # a judge not yet known to lack logprobs: scores only if it does
            try:
                return await judge_trajectories(
                    trajectories, judge=judge, rubric=rubric, tools=tools, method="verdict",
                    criteria=criteria, reference=reference,
                )  # fmt: skip
            except JudgeError:
                if judge.gives_logprobs is not False or criteria is not None:
                    raise
                logger.warning(
                    "judge %r returns no logprobs for verdicts: judging with group scores from now on",
                    judge.name,
                )
                method = "scores"
    if not trajectories:
        return Judgement(scores=[], judge=judge.name, distinct=0, method=method)
    if rubric is None:
        rubric = RUBRICS[method]
    tool_dicts = [tool_dict(tool) for tool in tools] if tools is not None else None
    conversations = [conversations_of(item, tool_dicts) for item in trajectories]
    keys = [  # what the judge would read: trajectories that differ only in call ids are one
        json.dumps([[c.name, transcript_of(c.messages, {}), c.tools] for c in convs], sort_keys=True)
        for convs in conversations
    ]
    labels: dict[str, str] = {}  # content -> the id the judge sees; identical trajectories share one
    for key in keys:
        labels.setdefault(key, str(len(labels) + 1))
    ids = list(labels.values())
    unique = [conversations[keys.index(key)] for key in labels]
    judgement = Judgement(scores=[], judge=judge.name, distinct=len(unique), method=method)
    if reference:
        judgement.reference = await ask_reference(judge, unique, judgement)
    if method == "verdict":
        by_id = await ask_verdicts(judge, unique, ids, rubric, judgement, criteria)
    elif method == "pairwise":
        by_id = await ask_pairwise(judge, unique, ids, rubric, judgement)
    else:
        messages = scores_prompt(unique, ids, rubric, judgement.reference)
        path = cache_path(judge, messages)
        cached = read_cache(path, ids) if path is not None else None
        if cached is not None:
            by_id, judgement.cached = cached, True
        else:
            by_id = await ask_scores(judge, messages, ids, judgement)
            if path is not None:
                write_cache(path, by_id)
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


async def ruler(
    trajectories: Sequence[TrajectoryLike], *, judge: Judge, **options: Unpack[JudgeOptions]
) -> list[Score]:
    """Deprecated: :func:`score_trajectories`. Keeps 0.1's default ``method="scores"``."""
    warn("journeyman.ruler.ruler", "journeyman.judge.score_trajectories (its default method is 'auto')")
    return await _ruler_01(trajectories, judge=judge, **options)


async def ruler_score_group(group: TrajectoryGroup, *, judge: Judge, **options: Any) -> TrajectoryGroup:
    """Deprecated: :func:`judge_group`. Keeps 0.1's defaults ``method="scores"``, ``reward_from="score"``."""
    warn(
        "journeyman.ruler.ruler_score_group",
        "journeyman.judge.judge_group (its defaults are method='auto', reward_from='best')",
    )
    return await _judge_group_01(group, judge=judge, **options)


async def _judge_group_01(
    group: TrajectoryGroup,
    *,
    judge: Judge,
    method: Method = "scores",
    reward_from: RewardFrom = "score",
    **options: Any,
) -> TrajectoryGroup:
    return await judge_group(group, judge=judge, method=method, reward_from=reward_from, **options)


async def _ruler_01(
    trajectories: Sequence[TrajectoryLike], *, judge: Judge, **options: Unpack[JudgeOptions]
) -> list[Score]:
    options.setdefault("method", "scores")
    return await score_trajectories(trajectories, judge=judge, **options)


callable_module(  # jm.ruler(...) of 0.1
    __name__, _ruler_01, "journeyman.judge.score_trajectories(...) (its default method is 'auto')"
)
