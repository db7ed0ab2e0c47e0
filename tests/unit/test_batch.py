"""Token-exact assembly of training sequences from recorded model turns (no model needed)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

import journeyman as jm
from journeyman.backend.training.batch import TrainSequence, build_batch, history_sequences, pack
from journeyman.config import TrainConfig
from journeyman.errors import InvalidDataError
from journeyman.trajectory import History


def turn(prompt: list[int], completion: list[int], logprobs: list[float] | None = None) -> dict[str, Any]:
    return {
        "type": "model_turn",
        "message": {"role": "assistant", "content": "x"},
        "prompt_token_ids": prompt,
        "completion_token_ids": completion,
        "logprobs": logprobs if logprobs is not None else [-0.5] * len(completion),
    }


def test_consecutive_turns_merge_into_one_sequence() -> None:
    history = History(
        conversation=[
            {"role": "user", "content": "q"},
            turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
            {"role": "tool", "tool_call_id": "c", "content": "r"},
            turn([1, 2, 3, 10, 11, 20, 21], [12, 13], [-0.3, -0.4]),
        ]
    )
    counts: Counter[str] = Counter()
    (sequence,) = history_sequences(history, None, counts)
    assert sequence.tokens == [1, 2, 3, 10, 11, 20, 21, 12, 13]
    assert sequence.mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]  # only what the model sampled is trained
    lps = sequence.sampling_logprobs
    assert [lp for lp, m in zip(lps, sequence.mask, strict=True) if m] == [-0.1, -0.2, -0.3, -0.4]
    assert all(math.isnan(lp) for lp, m in zip(lps, sequence.mask, strict=True) if not m)
    assert counts["data/prefix_breaks"] == 0 and counts["data/model_turns"] == 2


def test_a_prefix_break_starts_a_new_sequence_and_is_counted() -> None:
    history = History(
        conversation=[turn([1, 2], [10, 11]), turn([1, 2, 10, 99, 5], [12])]
    )  # re-rendered differently
    counts: Counter[str] = Counter()
    sequences = history_sequences(history, None, counts)
    assert [s.tokens for s in sequences] == [[1, 2, 10, 11], [1, 2, 10, 99, 5, 12]]
    assert [s.mask for s in sequences] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert counts["data/prefix_breaks"] == 1


def test_missing_logprobs_become_nan_and_turns_without_tokens_need_a_tokenizer() -> None:
    history = History(conversation=[{**turn([1], [5, 6]), "logprobs": [None, -1.0]}])
    (sequence,) = history_sequences(history, None, Counter())
    assert math.isnan(sequence.sampling_logprobs[1]) and sequence.sampling_logprobs[2] == -1.0
    untokenised = History(
        conversation=[{"type": "model_turn", "message": {"role": "assistant", "content": "hi"}}]
    )
    with pytest.raises(InvalidDataError, match="no recorded tokens and no tokenizer"):
        history_sequences(untokenised, None, Counter())


def _group(rewards: list[float | None], completion: list[int] | None = None) -> jm.TrajectoryGroup:
    return jm.TrajectoryGroup(
        [
            jm.Trajectory(
                conversation=[turn([1, 2, 3], [7, 8, 9] if completion is None else completion)], reward=r
            )
            for r in rewards
        ]
    )


def test_batch_keeps_scored_trajectories_with_their_groups() -> None:
    group = _group([1.0, 0.0, None])
    group.record_failure(RuntimeError("tool broke"))
    batch = build_batch([group, _group([0.5, 0.5])], None, TrainConfig())
    assert batch.rewards == [1.0, 0.0, 0.5, 0.5]
    assert batch.groups == [0, 0, 1, 1]
    assert [s.trajectory for s in batch.sequences] == [0, 1, 2, 3]
    assert batch.counts["data/unscored_trajectories"] == 1
    assert batch.counts["data/failures"] == 1
    assert batch.counts["data/groups"] == 2


def test_additional_histories_share_the_trajectory() -> None:
    trajectory = jm.Trajectory(
        conversation=[turn([1], [2])], additional_histories=[{"conversation": [turn([5], [6])]}], reward=1.0
    )
    batch = build_batch([jm.TrajectoryGroup([trajectory])], None, TrainConfig())
    assert [(s.tokens, s.trajectory) for s in batch.sequences] == [([1, 2], 0), ([5, 6], 0)]


def test_overlong_sequences_are_truncated_or_excluded_and_counted() -> None:
    long_group = _group([1.0, 0.0], completion=list(range(100, 110)))  # 3 prompt + 10 completion tokens
    truncated = build_batch([long_group], None, TrainConfig(max_seq_len=8))
    assert [len(s) for s in truncated.sequences] == [8, 8]
    assert truncated.counts["data/truncated_sequences"] == 2
    assert truncated.counts["data/truncated_trained_tokens"] == 10
    excluded = build_batch([long_group], None, TrainConfig(max_seq_len=8, overlong="exclude"))
    assert excluded.sequences == []
    assert excluded.counts["data/excluded_overlong_sequences"] == 2
    assert excluded.counts["data/excluded_overlong_tokens"] == 20
    nothing_left = build_batch([long_group], None, TrainConfig(max_seq_len=3))
    assert nothing_left.sequences == [] and nothing_left.counts["data/sequences_without_trained_tokens"] == 2


def test_empty_completions_are_counted() -> None:
    batch = build_batch([_group([1.0], completion=[])], None, TrainConfig())
    assert batch.counts["data/empty_completions"] == 1


def test_pack_respects_the_token_budget() -> None:
    sequences = [TrainSequence([0] * n, [1] * n, [0.0] * n) for n in (10, 3, 7, 7, 2, 30)]
    micro_batches = pack(sequences, token_budget=20)
    rows = [row for mb in micro_batches for row in mb]
    assert all(len(row.sequences) == 1 and row.prefix == 0 for row in rows)  # nothing untrained to share
    assert sorted(len(row) for row in rows) == [2, 3, 7, 7, 10, 30]
    for micro_batch in micro_batches:
        padded = len(micro_batch) * max(len(row) for row in micro_batch)
        assert padded <= 20 or len(micro_batch) == 1
    assert [[len(row) for row in mb] for mb in micro_batches] == [[30], [10, 7], [7, 3], [2]]


def _sequence(prompt: list[int], completion: list[int]) -> TrainSequence:
    tokens = prompt + completion
    return TrainSequence(tokens, [0] * len(prompt) + [1] * len(completion), [0.0] * len(tokens))


def test_pack_shares_a_group_prompt_once_and_never_a_trained_token() -> None:
    prompt_a, prompt_b = [5, 6, 7, 8], [5, 6, 9]
    sequences = [
        _sequence(prompt_a, [1, 2]),
        _sequence(prompt_b, [3]),
        _sequence(prompt_a, [1, 3, 4]),
        _sequence(prompt_a, [1, 2]),  # identical to the first: shares only the untrained prompt
        _sequence(prompt_b, [3, 3]),
    ]
    rows = [row for mb in pack(sequences, token_budget=100) for row in mb]
    by_prompt = {tuple(row.sequences[0].tokens[: row.prefix]): row for row in rows}
    assert set(by_prompt) == {tuple(prompt_a), tuple(prompt_b)}
    row_a = by_prompt[tuple(prompt_a)]
    assert len(row_a.sequences) == 3 and len(row_a) == 4 + 2 + 3 + 2
    for row in rows:
        tokens, positions, segments, where = row.layout()
        assert len(tokens) == len(row)
        for sequence, index in zip(row.sequences, where, strict=True):
            # Every token sits at its own position, and sees exactly its own sequence's earlier tokens.
            assert [tokens[i] for i in index] == sequence.tokens
            assert [positions[i] for i in index] == list(range(len(sequence)))
            for q, i in enumerate(index):
                visible = [k for k in range(len(tokens)) if k <= i and (k >= segments[i] or k < row.prefix)]
                assert visible == index[: q + 1]
            assert all(sequence.mask[t] == 0 for t in range(row.prefix))


def test_pack_keeps_rows_apart_when_sharing_costs_more() -> None:
    sequences = [_sequence([5, 6, 7, 8], [1, n]) for n in range(4)]
    shared = pack(sequences, token_budget=100)
    assert [len(row.sequences) for mb in shared for row in mb] == [4]
    expensive = pack(sequences, token_budget=100, cost=lambda n: float(n) ** 3)
    assert [len(row.sequences) for mb in expensive for row in mb] == [1, 1, 1, 1]
    over_budget = pack(sequences, token_budget=8)
    assert all(len(row) <= 8 for mb in over_budget for row in mb)


def test_pack_without_sharing_gives_each_sequence_a_row_of_its_own() -> None:
    """For an engine that attends causally over a whole row (Unsloth drops the tree mask while
    training): no sibling may sit in another's row, however cheap sharing would be."""
    sequences = [_sequence([5, 6, 7, 8], [1, n]) for n in range(4)]
    rows = [row for mb in pack(sequences, token_budget=100, share_prefix=False) for row in mb]
    assert [len(row.sequences) for row in rows] == [1, 1, 1, 1]
    assert sorted(row.sequences[0].tokens for row in rows) == sorted(s.tokens for s in sequences)
    assert all(len(row) == len(row.sequences[0]) for row in rows)  # nothing left out, nothing shared
