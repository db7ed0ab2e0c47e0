"""Data-parallel sharding and the vLLM parallel settings (no model, no process group)."""

from __future__ import annotations

from pathlib import Path

from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from journeyman.backend.training.batch import TrainSequence
from journeyman.backend.training.distributed import shard, world


def _sequence(trajectory: int, length: int) -> TrainSequence:
    return TrainSequence([1] * length, [1] * length, [0.0] * length, trajectory=trajectory)


def test_shards_cover_the_batch_once_keep_trajectories_whole_and_balance_tokens() -> None:
    sequences = [_sequence(t, 10 + 7 * t) for t in range(9)] + [_sequence(3, 40), _sequence(8, 5)]
    shards = [shard(sequences, rank, 3) for rank in range(3)]
    assert sorted(id(s) for part in shards for s in part) == sorted(map(id, sequences))
    owners = [{s.trajectory for s in part} for part in shards]
    assert not (owners[0] & owners[1] or owners[0] & owners[2] or owners[1] & owners[2])
    tokens = [sum(map(len, part)) for part in shards]
    assert max(tokens) - min(tokens) <= max(map(len, sequences))
    assert shard(sequences, 0, 1) == sequences
    assert shard(sequences[:1], 1, 2) == []  # fewer trajectories than ranks: a rank trains nothing


def test_world_outside_a_process_group_is_one_process() -> None:
    assert world() == (0, 1)


def test_vllm_parallel_settings_reach_the_command_line() -> None:
    server = VLLMServer(VLLMConfig(model="m", port=1, device="cuda"), log_path=Path("x.log"))
    assert "--tensor-parallel-size" not in server.command()
    config = VLLMConfig(model="m", port=1, device="cuda", tensor_parallel_size=2, data_parallel_size=4)
    command = VLLMServer(config, log_path=Path("x.log")).command()
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--data-parallel-size") + 1] == "4"
