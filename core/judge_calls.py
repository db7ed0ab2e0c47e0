"""The judge's calls, one way of judging each: a group's scores written out as JSON, a verdict per
attempt read from the first token's logprobs, pairwise comparisons, and the reference answer;
each retried on a failure, each valid answer cached.
Part of :mod:`journeyman.ruler`; names with a leading underscore are its own, not API.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from journeyman.errors import JudgeError
from journeyman.judge_client import Judge, JudgeCallError
from journeyman.judge_prompts import (
    PAIRWISE_QUESTION,
    PAIRWISE_SYSTEM,
    REFERENCE_QUESTION,
    REFERENCE_SYSTEM,
    REFERENCE_TOKENS,
    Conversation,
    prompt_layout,
    scores_schema,
    shared_start,
    tool_lines,
    trajectory_body,
    transcript_of,
    verdict_prompts,
)
from journeyman.judgements import (
    InvalidAnswer,
    Judgement,
    Score,
    cache_path,
    parse_scores,
    read_cache,
    write_cache,
)

logger = logging.getLogger("journeyman.ruler")

_T = TypeVar("_T")

_ENTRY_TOKENS = 48
"""Tokens for one schema entry besides its explanation: id, keys, score, punctuation, some spaces."""


async def _retrying(judge: Judge, judgement: Judgement, call: Callable[[], Awaitable[_T]], failed: str) -> _T:
    """``call()`` until it succeeds, at most ``1 + judge.max_retries`` times, waiting
    ``judge.retry_delay`` (doubled each time) between tries; each failure goes to
    ``judgement.retries``. Then :class:`JudgeError`: ``failed``, formatted with ``attempts``, and why."""
    attempts = 1 + judge.max_retries
    reasons = []
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except (JudgeCallError, InvalidAnswer) as error:
            reasons.append(f"attempt {attempt}: {error}")
            judgement.retries.append(reasons[-1])
            logger.warning("judge %r, attempt %d of %d: %s", judge.name, attempt, attempts, error)
            if attempt < attempts:
                await asyncio.sleep(judge.retry_delay * 2 ** (attempt - 1))
    raise JudgeError(failed.format(attempts=attempts, reasons="; ".join(reasons)))


async def ask_scores(
    judge: Judge, messages: list[dict[str, str]], ids: list[str], judgement: Judgement
) -> dict[str, Score]:
    """Ask until the answer holds one valid score per id, at most ``1 + judge.max_retries`` times."""
    schema = scores_schema(ids, judge.explanation_max_chars)
    max_tokens = None
    if judge.explanation_max_chars is not None:  # each token holds at least one character
        max_tokens = len(ids) * (judge.explanation_max_chars + _ENTRY_TOKENS) + 16

    async def attempt() -> dict[str, Score]:
        judgement.attempts += 1
        bound = max_tokens if judge.uses_schema else None  # a freely written object needs more
        judgement.answer = await judge.complete(messages, schema, max_tokens=bound)
        return parse_scores(judgement.answer, ids)

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
    path = cache_path(judge, messages)
    cached = read_cache(path, ["verdict"]) if path is not None else None
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
        write_cache(path, {"verdict": score})
    return score, False


async def ask_verdicts(
    judge: Judge,
    unique: list[list[Conversation]],
    ids: list[str],
    rubric: str,
    judgement: Judgement,
    criteria: Sequence[str] | None,
) -> dict[str, Score]:
    """Each distinct trajectory judged alone, its score P(yes) / (P(yes) + P(no)); with criteria,
    the product of each criterion's (the chance that it meets them all, were they independent); by id."""
    prompts = verdict_prompts(unique, rubric, criteria, judgement.reference)
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


async def ask_reference(judge: Judge, unique: list[list[Conversation]], judgement: Judgement) -> str:
    """How the task should be done, in the judge's words, asked once for the group: the tools, the
    system prompt and the last request before the attempts (not the whole shared start, whose
    worked examples would cost a small judge seconds to read and tell it nothing new)."""
    messages = unique[0][0].messages
    shared = shared_start(unique)
    first = next((n for n, m in enumerate(messages) if n >= shared and m["role"] == "assistant"), None)
    before = messages[:first] if shared and first is not None else messages
    request = next((m for m in reversed(before) if m["role"] == "user"), None)
    task = [m for m in before if m["role"] == "system"] + ([request] if request is not None else [])
    parts = []
    tools = unique[0][0].tools
    if tools:
        parts.append(f"<available_tools>\n{tool_lines(tools)}\n</available_tools>")
    parts += [f"<task>\n{transcript_of(task, {})}\n</task>", REFERENCE_QUESTION]
    prompt = [
        {"role": "system", "content": REFERENCE_SYSTEM},
        {"role": "user", "content": "\n".join(parts)},
    ]
    path = cache_path(judge, prompt)
    cached = read_cache(path, ["reference"]) if path is not None else None
    if cached is not None:
        return cached["reference"].explanation

    async def attempt() -> str:
        judgement.attempts += 1
        text = (await judge.complete(prompt, max_tokens=REFERENCE_TOKENS)).strip()
        if not text:
            raise InvalidAnswer("an empty reference")
        return text

    failed = f"judge {judge.name!r} wrote no reference in {{attempts}} attempts: {{reasons}}"
    text = await _retrying(judge, judgement, attempt, failed)
    if path is not None:  # stored as a score's explanation: one cache format for every judge call
        write_cache(path, {"reference": Score(0.0, text, 0.0)})
    return text


async def ask_pairwise(
    judge: Judge, unique: list[list[Conversation]], ids: list[str], rubric: str, judgement: Judgement
) -> dict[str, Score]:
    """Every ordered pair of distinct trajectories; a trajectory's score is its mean chance of
    winning, each pair's chance the mean of its two orders (so the order shown cancels out)."""
    n = len(unique)
    if n == 1:
        return {ids[0]: Score(0.5, "the only distinct attempt: nothing to compare it with", 0.5)}
    shared, tools_shared, head = prompt_layout(unique, judgement.reference)
    bodies = [trajectory_body(conversations, shared, tools_shared) for conversations in unique]
    system = {"role": "system", "content": PAIRWISE_SYSTEM.format(rubric=rubric.strip())}
    orders = [(i, j) for i in range(n) for j in range(n) if i != j]
    prompts = [
        [system, {"role": "user", "content": "\n".join(
            [*head, f"<attempt id=\"A\">\n{bodies[i]}\n</attempt>", f"<attempt id=\"B\">\n{bodies[j]}\n</attempt>",
             PAIRWISE_QUESTION]
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
