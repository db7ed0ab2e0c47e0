"""One RL step, journeyman vs TRL's GRPOTrainer, on the same model, shapes and LoRA config.

A step = a group of 8 rollouts x 64 new tokens for one prompt, rewards, one optimizer step.
Both sides use TRL's defaults where they overlap: DAPO loss, gradient checkpointing, bf16 where
the machine computes in bf16 (float32 on CPUs without bf16 instructions, where bf16 is emulated
and ~500x slower: both sides then run float32, as journeyman's trainer picks by itself).
journeyman: rollouts through the gateway to vLLM (bound to its cores), the GRPO LoRA trainer,
and the new adapter deployed back to vLLM. TRL: GRPOTrainer with HF generate inside the step.
Each side runs in its own process (so peak memory is its own), 4 steps, the first dropped as
warm-up. Target: journeyman >= 3x faster; lower peak memory. ``--model`` picks the embedded
model (``qwen2.5-coder-0.5b``: with checkpointing only, the adapter served as LoRA and merged,
and TRL; its servers run eager, as compiling the 0.5B's graphs takes minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP, TOKENS, STEPS = 8, 64, 4
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [f"Write one sentence about the number {n}." for n in range(STEPS)]
MODEL = os.environ.get("BENCH_MODEL", "smollm2-135m")


def reward(text: str) -> float:
    """Any reward with spread will do for timing: the share of distinct words."""
    words = text.split()
    return len(set(words)) / max(1, len(words))


def peak_rss_gib() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across
    execve, so a child started from a big parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


async def ours() -> dict[str, object]:
    import openai

    import journeyman as jm
    from bench.common import serving_stack
    from journeyman.backend.training.trainer import Trainer
    from journeyman.config import LoRAConfig, TrainConfig
    from journeyman.store import ModelStore

    # Same as TRL's defaults: DAPO loss, gradient checkpointing on (unless CHECKPOINTING=0).
    checkpointing = os.environ.get("CHECKPOINTING", "1") == "1"
    config = TrainConfig(loss="dapo", learning_rate=1e-5, gradient_checkpointing=checkpointing)
    cores = os.environ.get("VLLM_CORES", "0-1")  # rollouts and training alternate: each may use both cores
    merged = os.environ.get("MERGED", "0") == "1"  # each adapter merged into vLLM's weights (no LoRA in vLLM)
    with (
        serving_stack(
            served_name="base",
            model=MODEL,
            max_lora_rank=RANK,
            cpu_cores=cores,
            reserved_cpus=0,
            merge_adapters=merged,
            extra_args=("--enforce-eager",) if MODEL != "smollm2-135m" else (),
        ) as stack,
        tempfile.TemporaryDirectory() as tmp,
    ):
        trainer = Trainer(
            stack.model_dir, ModelStore("bench", "agent", root=tmp), lora=LoRAConfig(rank=RANK, alpha=ALPHA),
            threads=int(os.environ.get("TRAINER_THREADS", "2")),
            deploy=lambda path, step: stack.router.deploy("agent", path, step),
        )  # fmt: skip
        trainer.load()
        await stack.router.deploy("agent", trainer.adapter_path(0), 0)
        client = openai.AsyncOpenAI(
            base_url=stack.gateway.base_url + "/v1", api_key="-", max_retries=0, timeout=600
        )
        records = stack.gateway.gateway.records
        steps, phases = [], []
        for prompt in PROMPTS:
            start = time.perf_counter()
            messages = [{"role": "user", "content": prompt}]

            async def rollout(messages: list[dict[str, str]]) -> jm.Trajectory:
                response = await client.chat.completions.create(
                    model="agent", messages=messages, max_tokens=TOKENS, temperature=1.0,
                    extra_body={"min_tokens": TOKENS, "ignore_eos": True},
                )  # fmt: skip
                record = records.get(response.id)
                assert record is not None
                text = response.choices[0].message.content or ""
                return jm.Trajectory(conversation=[*messages, record.model_turn()], reward=reward(text))

            group = jm.TrajectoryGroup(await asyncio.gather(*(rollout(messages) for _ in range(GROUP))))
            rolled = time.perf_counter()
            result = await trainer.train([group], config)
            steps.append(time.perf_counter() - start)
            phases.append(
                {
                    "rollouts": rolled - start,
                    **{k: v for k, v in result.metrics.items() if k.startswith("time/")},
                }
            )
        await client.close()
    return {"steps": steps, "phases": phases, "peak_rss_gib": peak_rss_gib()}


def trl() -> dict[str, object]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from journeyman.backend.models import prepare_model
    from journeyman.backend.training.trainer import bf16_supported

    torch.set_num_threads(2)
    model_dir = prepare_model(MODEL)
    bf16 = bf16_supported()  # the precision journeyman's trainer picks on this machine
    steps: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            steps.append(time.perf_counter() - self.start)

    def reward_fn(completions: list[object], **kwargs: object) -> list[float]:
        return [reward(c[0]["content"] if isinstance(c, list) else str(c)) for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=GROUP, num_generations=GROUP, max_completion_length=TOKENS,
            generation_kwargs={"min_new_tokens": TOKENS}, learning_rate=1e-5, loss_type="dapo", max_steps=STEPS,
            use_cpu=True, bf16=bf16, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if bf16 else torch.float32
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
            peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM"),
            callbacks=[Timer()],
        )  # fmt: skip
        trainer.train()
    return {"steps": steps, "peak_rss_gib": peak_rss_gib()}


def run(which: str, **extra_env: str) -> dict[str, object]:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": root, **extra_env}
    done = subprocess.run(
        [sys.executable, "-m", "bench.rl_step", "--child", which],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{which} failed:\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(lines[-1])
    return result


def measure(model: str) -> str:
    from bench.common import machine, table

    os.environ["BENCH_MODEL"] = model
    variants = {
        "ours": {},
        "ours_no_ckpt": {"CHECKPOINTING": "0"},
        "ours_merged": {"MERGED": "1"},
        "ours_merged_no_ckpt": {"MERGED": "1", "CHECKPOINTING": "0"},
    }
    if model != "smollm2-135m":  # minutes per variant: the two ways of serving, and TRL
        variants = {name: variants[name] for name in ("ours", "ours_merged")}
    results = {name: run("ours", **env) for name, env in variants.items()}
    results["trl"] = run("trl")
    median = {name: statistics.median(r["steps"][1:]) for name, r in results.items()}  # type: ignore[index]
    labels = {
        "ours": "journeyman, adapter served as LoRA, gradient checkpointing on (as TRL)",
        "ours_no_ckpt": "journeyman, gradient checkpointing off",
        "ours_merged": "journeyman, adapter merged into vLLM's weights, checkpointing on",
        "ours_merged_no_ckpt": "journeyman, adapter merged into vLLM's weights, checkpointing off",
        "trl": "TRL GRPOTrainer (HF generate in the step)",
    }
    rows = [
        (labels[name], f"{median[name]:.2f}", f"{median['trl'] / median[name]:.2f}x",
         f"{r['peak_rss_gib']:.2f}" + (" + vLLM" if name != "trl" else ""))
        for name, r in results.items()
    ]  # fmt: skip
    splits = []
    for name in variants:
        phases = results[name]["phases"][1:]  # type: ignore[index]
        splits.append(
            f"{labels[name]}: "
            + ", ".join(f"{k} {statistics.median(p[k] for p in phases):.2f} s" for k in phases[0])
        )
    return (
        f"### One RL step, {model}: {GROUP} rollouts x {TOKENS} tokens + a LoRA r={RANK} step ({machine()})\n\n"
        + table(["system", "median s/step", "vs TRL", "peak RSS GiB"], rows)
        + "\n\nStep split (medians). "
        + "; ".join(splits)
        + ". "
        "journeyman's rollouts go through the gateway to vLLM, whose own memory (about 4.3 GB "
        "resident) is not in its column.\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=["ours", "trl"])
    parser.add_argument("--model", default=MODEL, help="embedded model alias")
    args = parser.parse_args()
    if args.child == "ours":
        print(json.dumps(asyncio.run(ours())))
    elif args.child == "trl":
        print(json.dumps(trl()))
    else:
        print(measure(args.model))
