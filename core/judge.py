"""Judging: an LLM :class:`Judge`, the functions that judge a group of attempts and make rewards
of the scores, and the calibration that says whether a judge can be trusted to train a model.

::

    from journeyman.judge import Judge, calibrate_judge, judge_group

    judge = Judge("o4-mini", base_url="https://api.openai.com/v1", api_key=key)
    report = await calibrate_judge(groups_with_known_rewards, judge)
    judged = await judge_group(group, judge=judge, rubric="...")   # a copy with rewards set

In a training loop, ``jm.JudgeReward(judge, ...)`` does the same for each group.
"""

from journeyman.calibration import Calibration, GroupCalibration, calibrate_judge
from journeyman.errors import JudgeCallError, JudgeError
from journeyman.judge_client import Judge
from journeyman.judge_prompts import DEFAULT_PAIRWISE_RUBRIC, DEFAULT_RUBRIC, DEFAULT_VERDICT_RUBRIC
from journeyman.judgements import Judgement, Score
from journeyman.ruler import (
    JudgeOptions,
    Method,
    RewardFrom,
    judge_group,
    judge_trajectories,
    judged_rewards,
    method_for,
    score_trajectories,
)

__all__ = [
    "DEFAULT_PAIRWISE_RUBRIC",
    "DEFAULT_RUBRIC",
    "DEFAULT_VERDICT_RUBRIC",
    "Calibration",
    "GroupCalibration",
    "Judge",
    "JudgeCallError",
    "JudgeError",
    "JudgeOptions",
    "Judgement",
    "Method",
    "RewardFrom",
    "Score",
    "calibrate_judge",
    "judge_group",
    "judge_trajectories",
    "judged_rewards",
    "method_for",
    "score_trajectories",
]
