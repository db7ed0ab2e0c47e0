"""Which device each torchrun rank trains on: a GPU of its own, or the CPU; never a GPU that is
not there (no process group, no GPU needed)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from journeyman.backend.training import distributed
from journeyman.backend.training.distributed import chosen_device, init_distributed, rank_device
from journeyman.errors import ConfigError


def _devices(ranks: int, gpus: int, train_device: str) -> list[str]:
    return [rank_device(rank, gpus, train_device, local_world_size=ranks) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_cpu_training_puts_every_rank_on_the_cpu_whatever_the_gpus(ranks: int, gpus: int) -> None:
    assert _devices(ranks, gpus, "cpu") == ["cpu"] * ranks


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("train_device", ["auto", "cuda"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_cuda_training_gives_each_rank_its_own_gpu_or_says_there_are_too_few(
    ranks: int, gpus: int, train_device: str
) -> None:
    if ranks <= gpus:
        assert _devices(ranks, gpus, train_device) == [f"cuda:{rank}" for rank in range(ranks)]
        return
    for rank in range(ranks):  # every rank refuses, not only those past the last GPU
        with pytest.raises(ConfigError) as caught:
            rank_device(rank, gpus, train_device, local_world_size=ranks)
        message = str(caught.value)
        assert f"{ranks} training processes on this machine, but it has {gpus} CUDA GPU(s)" in message
        assert f"lower --nproc-per-node to {gpus}" in message and "train_device='cpu'" in message


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_without_a_gpu_auto_trains_on_the_cpu_and_cuda_is_refused(ranks: int) -> None:
    assert _devices(ranks, 0, "auto") == ["cpu"] * ranks
    with pytest.raises(ConfigError, match=re.escape("sees no CUDA GPU")):
        rank_device(0, 0, "cuda", local_world_size=ranks)


def test_a_rank_past_the_gpus_is_refused_without_torchrun_s_local_world_size() -> None:
    assert rank_device(1, 2, "cuda") == "cuda:1"
    with pytest.raises(ConfigError, match=r"3 training processes .* 2 CUDA GPU"):
        rank_device(2, 2, "cuda")


def test_an_unknown_train_device_is_named() -> None:
    with pytest.raises(ConfigError, match="train_device must be auto, cpu or cuda, got 'gpu'"):
        rank_device(0, 1, "gpu")


@pytest.mark.parametrize(
    ("train_device", "device", "backend"),
    [("cuda", "cuda:1", "cpu:gloo,cuda:nccl"), ("cpu", "cpu", "gloo")],
)
def test_a_rank_sets_a_cuda_device_and_nccl_only_when_it_trains_on_cuda(
    monkeypatch: pytest.MonkeyPatch, train_device: str, device: str, backend: str
) -> None:
    """What init_distributed does with torchrun's variables on a 2-GPU machine (its calls into
    torch recorded instead of made)."""
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda b: calls.append(("init_process_group", b)))
    monkeypatch.setattr(distributed, "_chosen_device", None)
    assert init_distributed(train_device) == (0, 1)  # no group was made: world() is one process
    assert chosen_device() == device
    expected = [("set_device", device)] if device != "cpu" else []
    assert calls == [*expected, ("init_process_group", backend)]


def test_too_many_ranks_fail_before_joining_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    joined: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", joined.append)
    with pytest.raises(ConfigError, match=r"4 training processes on this machine, but it has 1 CUDA GPU"):
        init_distributed()
    assert not joined
