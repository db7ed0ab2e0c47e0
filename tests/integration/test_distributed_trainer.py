"""Data-parallel training: two gloo processes under torchrun take the same step as one process.

The file is also the torchrun entry point (``__main__`` below): each rank trains one step on its
share of the same groups and saves its LoRA weights for the test to compare.
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

CONFIG = TrainConfig(learning_rate=1e-3, micro_batch_tokens=64)


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


def lora_weights(trainer: Any) -> dict[str, Any]:
    return {name: p.detach().clone().contiguous() for name, p in trainer._trainable()}


def record_gradients(trainer: Any, into: dict[str, Any]) -> Any:
    """Keep the gradients the optimizer steps with (after the all-reduce)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        into.update({f"grad/{n}": p.grad.clone() for n, p in trainer._trainable() if p.grad is not None})

    return register_optimizer_step_pre_hook(hook)


def _rank_main(out: Path) -> None:
    from safetensors.torch import save_file

    from journeyman.backend.distributed import DataParallelTrainer

    rank = int(os.environ["RANK"])
    root = out / f"root{rank}"  # separate stores: rank 1 needs no shared disk and writes nothing
    trainer = DataParallelTrainer(
        "smollm2-135m", jm.ModelStore("test", "agent", root=root), threads=1, precision="fp32"
    )
    trainer.load()
    gradients: dict[str, Any] = {}
    record_gradients(trainer, gradients)
    result = trainer.train_step(groups(trainer.tokenizer), CONFIG)
    save_file(lora_weights(trainer) | gradients, str(out / f"rank{rank}.safetensors"))
    (out / f"metrics{rank}.json").write_text(json.dumps(result.metrics))


@pytest.mark.timeout(900)
def test_two_gloo_ranks_take_the_same_step_as_one_process(tmp_path: Path, model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from journeyman.backend.trainer import Trainer

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    single = Trainer(
        "smollm2-135m", jm.ModelStore("test", "agent", root=tmp_path / "single"), threads=1, precision="fp32"
    )
    single.load()
    before = lora_weights(single)
    gradients: dict[str, Any] = {}
    hook = record_gradients(single, gradients)
    expected = single.train_step(groups(single.tokenizer), CONFIG)
    hook.remove()
    reference = lora_weights(single)

    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    changed = 0
    for name, value in reference.items():
        for weights in ranks:
            # The summed gradient is the one-process gradient, up to float rounding (the ranks
            # pack different rows, so the sums run in another order) ...
            grad = gradients[f"grad/{name}"]
            scale = float(grad.abs().max()) or 1.0
            torch.testing.assert_close(weights[f"grad/{name}"], grad, rtol=1e-3, atol=1e-5 * scale, msg=name)
            # ... and so is the step. AdamW's first step is lr x g / (|g| + eps): where |g| is
            # near eps (1e-8) rounding in g moves it by up to ~lr/10 (measured: 5e-5, a few
            # elements in thousands); elsewhere it is exact to 1e-6.
            conditioned = grad.abs() > 1e-6
            assert torch.allclose(weights[name][conditioned], value[conditioned], atol=1e-6, rtol=0), name
            assert torch.allclose(weights[name], value, atol=0.1 * CONFIG.learning_rate, rtol=0), name
        changed += not torch.equal(value, before[name])
        assert torch.equal(ranks[0][name], ranks[1][name])  # the ranks stay identical
    assert changed == len(reference) // 2  # every lora_B moved (lora_A has no gradient at step 1)

    metrics = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in (0, 1)]
    for key in ("train/loss", "train/grad_norm", "train/entropy", "data/trained_tokens"):
        assert metrics[0][key] == pytest.approx(expected.metrics[key], rel=1e-4), key
        assert metrics[1][key] == metrics[0][key]
    # Each rank trained its own share: together they made at least as many micro-batches.
    assert metrics[0]["train/micro_batches"] >= expected.metrics["train/micro_batches"]
    # Only rank 0 wrote checkpoints (step 0 and step 1).
    assert jm.ModelStore("test", "agent", root=tmp_path / "root0").checkpoint_steps() == [0, 1]
    assert jm.ModelStore("test", "agent", root=tmp_path / "root1").checkpoint_steps() == []


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
