"""Data-parallel training: two gloo processes under torchrun take the same step as one process,
with the whole model on each rank (data parallel) or its layers sharded between them (FSDP).

The file is also the torchrun entry point (``__main__`` below): each rank trains one step on its
share of the same groups and saves its (whole) LoRA weights and gradients for the test to compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import journeyman as jm
from journeyman.config import TrainConfig
from journeyman.store import ModelStore

CONFIG = TrainConfig(learning_rate=1e-3, micro_batch_tokens=64)
SECOND = TrainConfig(
    learning_rate=1e-3, micro_batch_tokens=24, beta=0.04, gradient_checkpointing=True, max_grad_norm=1e-7
)
"""Step 2 of the FSDP test: a KL term (a reference pass), recomputed activations, and a clipped
gradient (the recorded gradients are the clipped ones, so the norm must be the global one)."""


def groups(tokenizer: Any) -> list[jm.TrajectoryGroup]:
    """Two questions with four answers each (rewards spread), token-exact."""
    result = []
    for question, answers in [
        ("What is 2+3?", [("5", 1.0), ("6", 0.0), ("It is 5.", 1.0), ("nine, I think", 0.0)]),
        ("Name a colour.", [("Blue.", 1.0), ("A dog", 0.0), ("Red is a colour.", 1.0), ("7", 0.0)]),
    ]:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        trajectories = []
        for answer, reward in answers:
            completion = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            turn = {
                "type": "model_turn",
                "message": {"role": "assistant", "content": answer},
                "prompt_token_ids": list(prompt),
                "completion_token_ids": completion,
                "logprobs": [-1.0] * len(completion),
            }
            trajectories.append(jm.Trajectory(conversation=[*messages, turn], reward=reward))
        result.append(jm.TrajectoryGroup(trajectories))
    return result


def whole(tensor: Any) -> Any:
    """The whole tensor of an FSDP shard (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def step_batch(step: int, tokenizer: Any) -> tuple[list[jm.TrajectoryGroup], TrainConfig]:
    """Step 1 trains on :func:`groups`. Step 2 on three answers to one question, each a
    micro-batch of its own (SECOND's budget is below any sequence): one rank runs two, the
    other one, so under FSDP it must run an idle pass to keep step."""
    if step == 1:
        return groups(tokenizer), CONFIG
    return [jm.TrajectoryGroup(groups(tokenizer)[0].trajectories[:3])], SECOND


def lora_weights(trainer: Any) -> dict[str, Any]:
    return {name: whole(p.detach()).clone().contiguous() for name, p in trainer._trainable()}


def record_gradients(trainer: Any, into: dict[str, Any]) -> Any:
    """Keep the gradients the optimizer steps with (after the all-reduce)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        into.update(
            {f"grad/{n}": whole(p.grad).clone() for n, p in trainer._trainable() if p.grad is not None}
        )

    return register_optimizer_step_pre_hook(hook)


def tiny_llama(folder: Path, model_dir: Path) -> Path:
    """A random 3-layer Llama with the embedded model's tokenizer and tied embeddings; odd sizes,
    so FSDP splits some LoRA weights unevenly."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=30, intermediate_size=45, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=2, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, folder / name)
    return folder


def run_ranks(out: Path, base: str, mode: str) -> None:
    """One training step on two gloo ranks, from the checkpoint rank 0 has (if any)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, str(out), base, mode,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _rank_main(out: Path, base: str, mode: str) -> None:
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from journeyman.backend.training.distributed import DataParallelTrainer, LeaderTrainer, follow

    rank = int(os.environ["RANK"])
    root = out / f"root{rank}"  # separate stores: rank 1 needs no shared disk and writes nothing
    if mode == "serve":  # as under `journeyman serve --fsdp`: rank 0 leads, rank 1 follows
        if rank == 0:
            store = ModelStore("test", "agent", root=root)
            leader = LeaderTrainer(base, store, threads=1, precision="fp32", fsdp=True)
            leader.load()
            leader.train_step(*step_batch(1, leader.tokenizer))
        else:
            follow()
        return
    trainer = DataParallelTrainer(
        base, ModelStore("test", "agent", root=root), threads=1, precision="fp32", fsdp=mode == "fsdp"
    )
    trainer.load()
    gradients: dict[str, Any] = {}
    record_gradients(trainer, gradients)
    plan, idle = trainer._micro_batches, []

    def recorded(*args: Any) -> Any:
        micro_batches = plan(*args)
        idle.append(sum(not trains for _, trains in micro_batches))
        return micro_batches

    trainer._micro_batches = recorded
    result = trainer.train_step(*step_batch(trainer.step + 1, trainer.tokenizer))
    result.metrics["test/idle_passes"] = float(sum(idle))
    layers = list(trainer.model.get_base_model().get_decoder().layers.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in layers)
    result.metrics["test/local_share"] = local / sum(p.numel() for p in layers)
    name = f"rank{rank}-step{result.step}"
    save_file(lora_weights(trainer) | gradients, str(out / f"{name}.safetensors"))
    (out / f"{name}.json").write_text(json.dumps(result.metrics))


def assert_same_step(
    ranks: list[dict[str, Any]], reference: dict[str, Any], gradients: dict[str, Any]
) -> None:
    import torch

    for name, value in reference.items():
        for weights in ranks:
            # The summed gradient is the one-process gradient, up to float rounding (the ranks
            # pack different rows, so the sums run in another order) ...
            grad = gradients[f"grad/{name}"]
            scale = float(grad.abs().max()) or 1.0
            torch.testing.assert_close(weights[f"grad/{name}"], grad, rtol=1e-3, atol=1e-5 * scale, msg=name)
            # ... and so is the step. AdamW's first step is lr x g / (|g| + eps): where |g| is
            # near eps (1e-8) rounding in g moves it by a share of lr (measured: 5e-5 in one run,
            # just over 1e-4 in another, a few elements in thousands), never by more than lr;
            # elsewhere it is exact to 1e-6.
            conditioned = grad.abs() > 1e-6
            assert torch.allclose(weights[name][conditioned], value[conditioned], atol=1e-6, rtol=0), name
            assert torch.allclose(weights[name], value, atol=CONFIG.learning_rate, rtol=0), name
        assert torch.equal(ranks[0][name], ranks[1][name])  # the ranks stay identical


class OneProcess:
    """The reference: a plain :class:`Trainer` in this process."""

    def __init__(self, base: str, root: Path) -> None:
        from journeyman.backend.training.trainer import Trainer

        self.trainer = Trainer(base, ModelStore("test", "agent", root=root), threads=1, precision="fp32")
        self.trainer.load()

    def step(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
        """One step on the groups: (LoRA weights after it, the gradients it stepped with, metrics)."""
        gradients: dict[str, Any] = {}
        hook = record_gradients(self.trainer, gradients)
        result = self.trainer.train_step(*step_batch(self.trainer.step + 1, self.trainer.tokenizer))
        hook.remove()
        return lora_weights(self.trainer), gradients, result.metrics


def rank_results(out: Path, step: int) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    from safetensors.torch import load_file

    weights = [load_file(str(out / f"rank{r}-step{step}.safetensors")) for r in (0, 1)]
    metrics = [json.loads((out / f"rank{r}-step{step}.json").read_text()) for r in (0, 1)]
    return weights, metrics


def assert_same_metrics(metrics: list[dict[str, float]], expected: dict[str, float]) -> None:
    for key in ("train/loss", "train/grad_norm", "train/entropy", "data/trained_tokens"):
        assert metrics[0][key] == pytest.approx(expected[key], rel=1e-4), key
        assert metrics[1][key] == metrics[0][key]


def moved(after: dict[str, Any], before: dict[str, Any]) -> int:
    import torch

    return sum(not torch.equal(value, before[name]) for name, value in after.items())


def test_two_gloo_ranks_take_the_same_step_as_one_process(tmp_path: Path, model_dir: Path) -> None:
    run_ranks(tmp_path, "smollm2-135m", "dp")
    single = OneProcess("smollm2-135m", tmp_path / "single")
    before = lora_weights(single.trainer)
    reference, gradients, expected = single.step()

    ranks, metrics = rank_results(tmp_path, 1)
    assert_same_step(ranks, reference, gradients)
    assert moved(reference, before) == len(reference) // 2  # every lora_B (lora_A has no gradient yet)
    assert_same_metrics(metrics, expected)
    # Each rank trained its own share: together they made at least as many micro-batches.
    assert metrics[0]["train/micro_batches"] >= expected["train/micro_batches"]
    # Only rank 0 wrote checkpoints (step 0 and step 1).
    assert ModelStore("test", "agent", root=tmp_path / "root0").checkpoint_steps() == [0, 1]
    assert ModelStore("test", "agent", root=tmp_path / "root1").checkpoint_steps() == []


@pytest.mark.parametrize("base", ["tiny", "smollm2-135m"])
def test_fsdp_ranks_take_the_same_steps_as_one_process(tmp_path: Path, model_dir: Path, base: str) -> None:
    """The base model's layers sharded across two ranks: the same gradients and adapter as one
    process, a checkpoint one process resumes from, and FSDP resuming from its own checkpoint."""
    import shutil

    import torch

    if base == "tiny":
        base = str(tiny_llama(tmp_path / "tiny", model_dir))
    run_ranks(tmp_path, base, "fsdp")
    single = OneProcess(base, tmp_path / "single")
    before = lora_weights(single.trainer)
    reference, gradients, expected = single.step()
    ranks, metrics = rank_results(tmp_path, 1)
    assert_same_step(ranks, reference, gradients)
    assert moved(reference, before) == len(reference) // 2
    assert_same_metrics(metrics, expected)
    assert ModelStore("test", "agent", root=tmp_path / "root1").checkpoint_steps() == []
    # Each rank held about half of the decoder layers' weights.
    assert [m["test/local_share"] == pytest.approx(0.5, abs=0.02) for m in metrics] == [True, True]

    # One process resumes from the FSDP checkpoint: the gathered adapter is rank 0's, and the
    # gathered optimizer state is the one process's, up to the rounding in the gradients.
    shutil.copytree(tmp_path / "root0", tmp_path / "resumed")
    resumed = OneProcess(base, tmp_path / "resumed")
    assert resumed.trainer.step == 1
    assert moved(lora_weights(resumed.trainer), ranks[0]) == 0
    state, expected_state = resumed.trainer._checkpoint_tensors()[1], single.trainer._checkpoint_tensors()[1]
    assert state.keys() == expected_state.keys() and len(state) == 3 * len(reference)
    for key, value in expected_state.items():
        scale = float(value.abs().max()) or 1.0
        torch.testing.assert_close(state[key], value, rtol=1e-3, atol=1e-5 * scale, msg=key)

    # Step 2 from that checkpoint, in one process and under FSDP (which resumes from it too).
    # The second step is compared from the same start: Adam amplifies the rounding of gradients
    # near its epsilon, so two runs that differ there at step 1 drift apart by up to lr at step 2.
    run_ranks(tmp_path, base, "fsdp")
    start = lora_weights(resumed.trainer)
    reference, gradients, expected = resumed.step()
    assert moved(reference, start) == len(reference)  # lora_A too, now that lora_B is not zero
    ranks, metrics = rank_results(tmp_path, 2)
    assert_same_step(ranks, reference, gradients)
    assert_same_metrics(metrics, expected)
    assert expected["train/grad_norm"] > 10 * (SECOND.max_grad_norm or 0)  # clipped
    assert sorted(m["test/idle_passes"] for m in metrics) == [0, 1]


@pytest.mark.timeout(300)
def test_fsdp_under_journeyman_serve_leader_and_follower(tmp_path: Path, model_dir: Path) -> None:
    """The follower builds its trainer from the leader's options, fsdp included (else the
    collectives would not match and the step would hang)."""
    import torch

    base = str(tiny_llama(tmp_path / "tiny", model_dir))
    run_ranks(tmp_path, base, "serve")
    reference, _, _ = OneProcess(base, tmp_path / "single").step()
    saved = lora_weights(OneProcess(base, tmp_path / "root0").trainer)  # rank 0's step-1 checkpoint
    for name, value in reference.items():
        assert torch.allclose(saved[name], value, atol=0.1 * CONFIG.learning_rate, rtol=0), name
    assert moved(saved, lora_weights(OneProcess(base, tmp_path / "fresh").trainer)) == len(saved) // 2


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
