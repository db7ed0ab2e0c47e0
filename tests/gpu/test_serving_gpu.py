"""The serving part, for a user's full CUDA set-up (``make setup`` installs CUDA vLLM): the
policy's vLLM server, a 1.5B judge's server and the trainer on one GPU under the memory plan,
what a sleep and a wake cost, and the trainer's logprobs against vLLM's on the tokens it sampled."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import journeyman as jm

POLICY, JUDGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


@pytest.fixture
def cuda_vllm(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("the serving part needs a CUDA GPU and CUDA vLLM")
    from journeyman.backend.settings import vllm_python

    if not vllm_python().exists():
        pytest.skip(f"the serving part needs CUDA vLLM in {vllm_python()} (make setup)")


def test_policy_judge_and_trainer_share_one_gpu(cuda_vllm: None, tmp_path: Path, record: Any) -> None:
    asyncio.run(_share_one_gpu(tmp_path, record))


async def _share_one_gpu(tmp_path: Path, record: Any) -> None:
    from journeyman.backend.local import LocalBackend
    from journeyman.backend.training.batch import build_batch
    from journeyman.config import TrainConfig

    async with LocalBackend(root=tmp_path, sleep_mode=True) as backend:
        model = jm.TrainableModel(name="gpu", project="gpu-check", base_model=POLICY, root=tmp_path)
        await model.register(backend)
        judge = await backend.start_judge(JUDGE)
        plan = backend.gpu_memory
        assert plan is not None and plan.fits
        record("memory plan", {"plan": plan.describe(), "trainer": backend.describe_trainer(model)})
        trainer = backend._trainer(model)
        assert trainer.device.type == "cuda"

        client = model.openai_client()
        messages = [{"role": "user", "content": "Count from one to twenty in words."}]
        response = await client.chat.completions.create(
            model=model.inference_name, messages=messages, max_tokens=64, temperature=1.0, seed=1
        )
        assert backend.records is not None
        completion = backend.records.get(response.id)
        assert completion is not None
        trajectory = jm.Trajectory(conversation=[*messages, completion.model_turn()], reward=1.0)
        group = jm.TrajectoryGroup(
            [trajectory, jm.Trajectory(conversation=trajectory.conversation, reward=0.0)]
        )
        (sequence, *_) = build_batch([group], trainer.tokenizer, TrainConfig()).sequences
        from tests.gpu.checks import logprobs_of

        training = logprobs_of(trainer, [sequence], share_prefix=True)
        pairs = zip(sequence.sampling_logprobs[1:], sequence.mask[1:], strict=True)
        sampling = torch.tensor([logprob for logprob, trained in pairs if trained])
        delta = sampling - training
        parity = {
            "tokens": len(sampling),
            "mean_abs_diff": float(delta.abs().mean()),
            "max_abs_diff": float(delta.abs().max()),
            "mismatch_kl": float(delta.mean()),
        }
        record("trainer vs vLLM logprobs", parity)
        assert judge.model == JUDGE.split("/")[-1]  # its own server, beside the policy's

        servers = backend._sleepers()
        assert servers, "sleep_mode=True on CUDA puts the policy's server to sleep for each step"
        start = time.perf_counter()
        await servers[0].sleep()
        slept = time.perf_counter() - start
        start = time.perf_counter()
        await servers[0].wake_up()
        woke = time.perf_counter() - start
        result = await model.train([group], TrainConfig(learning_rate=1e-5))
        record(
            "sleep mode",
            {
                "sleep_s": slept,
                "wake_s": woke,
                **{k: v for k, v in result.metrics.items() if k.startswith("time/")},
            },
        )
        assert parity["mean_abs_diff"] <= 0.01, parity  # the target in bf16
