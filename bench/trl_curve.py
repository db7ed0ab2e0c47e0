"""Who learns more per minute: the demo (journeyman) vs TRL's GRPOTrainer on the single-turn form.

The single-turn form of the demo's task: the prompt the demo's agent sends on its first call (the
system prompt with the tool schemas, the four worked examples, the question), one completion, and
reward 1 when it calls the right tool with the right numbers (``<tool_call>`` JSON), else 0. Same
model, LoRA (rank 8, alpha 16), learning rate, loss (DAPO), temperature (0.7), group of 8 and
4 questions per step as the demo; TRL runs for the same wall-clock budget.

Both final adapters are then evaluated by one evaluator (HF generate, the same held-out questions,
4 samples each at the training temperature): the share of first turns that call the right tool
with the right numbers. The training curves (that share among each step's rollouts, against
minutes) go to bench/trl_curve.png.

    python -m bench.trl_curve --journeyman-run <demo root>/demo/<name> [--minutes 15]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from bench.common import machine, table

PNG = Path(__file__).with_name("trl_curve.png")
RANK, ALPHA, LR, TEMPERATURE, GROUP, QUESTIONS, MAX_TOKENS = 8, 16, 5e-4, 0.7, 8, 4, 48
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def prompts(tokenizer: Any, model_dir: Path, scenarios: list[Any]) -> list[str]:
    """The demo agent's first prompt for each question, rendered by the served tool template."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from journeyman.backend.app.calculator import SYSTEM, TOOLS, WORKED_EXAMPLES
    from journeyman.backend.models import TOOL_TEMPLATE

    shots: list[dict[str, Any]] = []
    for message in WORKED_EXAMPLES:
        if message.type == "human":
            shots.append({"role": "user", "content": message.content})
        elif message.type == "tool":
            shots.append({"role": "tool", "content": message.content, "tool_call_id": message.tool_call_id})
        else:
            calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["args"])},
                }
                for c in message.tool_calls  # type: ignore[attr-defined]
            ]
            shots.append(
                {"role": "assistant", "content": message.content, **({"tool_calls": calls} if calls else {})}
            )
    template = (model_dir / TOOL_TEMPLATE).read_text()
    tools = [convert_to_openai_tool(t) for t in TOOLS]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": s.question}],
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        for s in scenarios
    ]


def right_call(completion: str, op: str, a: int, b: int) -> float:
    for match in _CALL.finditer(completion):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        args = call.get("arguments") if isinstance(call, dict) else None
        same = isinstance(args, dict) and sorted(map(str, args.values())) == sorted([str(a), str(b)])
        if call.get("name") == op and same:
            return 1.0
    return 0.0


def evaluate(model: Any, tokenizer: Any, texts: list[str], scenarios: list[Any], samples: int = 4) -> float:
    """Share of sampled first turns that call the right tool with the right numbers."""
    import torch

    torch.manual_seed(0)
    tokenizer.padding_side = "left"
    hits = []
    for start in range(0, len(texts), 8):  # 8 questions x 4 samples per generate call
        chunk = list(zip(texts[start : start + 8], scenarios[start : start + 8], strict=True))
        inputs = tokenizer([t for t, _ in chunk for _ in range(samples)], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **inputs, do_sample=True, temperature=TEMPERATURE, max_new_tokens=MAX_TOKENS,
                pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        rows = out[:, inputs["input_ids"].shape[1] :]
        for i, row in enumerate(rows):
            s = chunk[i // samples][1]
            hits.append(right_call(tokenizer.decode(row, skip_special_tokens=False), s.op, s.a, s.b))
    return sum(hits) / len(hits)


def train_trl(
    minutes: float, out: Path, texts: list[str], scenarios: list[Any], model_dir: Path
) -> list[tuple[float, float]]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    curve: list[tuple[float, float]] = []
    started = time.monotonic()

    class Budget(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                curve.append(((time.monotonic() - started) / 60, float(logs["reward"])))
                print(
                    f"TRL step {state.global_step}: reward {logs['reward']:.3f} at {curve[-1][0]:.1f} min",
                    flush=True,
                )

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if time.monotonic() - started > minutes * 60:
                control.should_training_stop = True

    def reward(completions: list[str], op: list[str], a: list[int], b: list[int], **_: Any) -> list[float]:
        return [right_call(c, o, x, y) for c, o, x, y in zip(completions, op, a, b, strict=True)]

    dataset = Dataset.from_list(
        [{"prompt": t, "op": s.op, "a": s.a, "b": s.b} for t, s in zip(texts, scenarios, strict=True)]
    )
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=GROUP * QUESTIONS, num_generations=GROUP,
        max_completion_length=MAX_TOKENS, temperature=TEMPERATURE, learning_rate=LR, loss_type="dapo",
        max_steps=10_000, use_cpu=True, bf16=True, report_to="none", save_strategy="no", logging_steps=1, seed=0,
    )  # fmt: skip
    torch.set_num_threads(2)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), reward_funcs=reward,
        args=args, train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"),
        peft_config=LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[Budget()],
    )  # fmt: skip
    trainer.train()
    trainer.model.save_pretrained(out / "adapter")
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--journeyman-run", type=Path, required=True, help="a finished demo's model folder")
    parser.add_argument("--minutes", type=float, default=15.0, help="TRL's wall-clock training budget")
    parser.add_argument("--out", type=Path, default=Path("/tmp/journeyman-trl-curve"))
    parser.add_argument(
        "--val-questions", type=int, default=None, help="fewer held-out questions (smoke runs)"
    )
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from journeyman.backend.app.calculator import make_scenarios
    from journeyman.backend.models import prepare_model
    from journeyman.store import ModelStore

    torch.set_num_threads(2)
    run = args.journeyman_run
    report = json.loads((run / "demo_report.json").read_text())
    config = report["config"]
    model_dir = prepare_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = make_scenarios(config["train_scenarios"], seed=config["seed"])
    val = make_scenarios(config["val_scenarios"], seed=config["seed"] + 10_000)[
        : args.val_questions
    ]  # as the demo
    curve = train_trl(args.minutes, args.out, prompts(tokenizer, model_dir, train), train, model_dir)

    val_texts = prompts(tokenizer, model_dir, val)
    scores = {}
    store = ModelStore(run.parent.name, run.name, root=run.parent.parent)
    rows = store.read_history()
    trl_minutes = curve[-1][0] if curve else 0.0
    # journeyman's adapter after as many minutes of training as TRL had: the demo's rollout row
    # of version k carries the minutes at the end of training step k + 1
    done = [
        r["step"] + 1
        for r in rows
        if r.get("split") == "rollouts" and r.get("elapsed_s", 0) <= trl_minutes * 60
    ]
    our_step = max([s for s in store.checkpoint_steps() if s <= max(done, default=0)], default=0)
    ours = store.checkpoint_path(our_step) / "adapter"
    for label, adapter in [
        ("base model", None),
        ("TRL GRPOTrainer", args.out / "adapter"),
        ("journeyman demo", ours),
    ]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        scores[label] = evaluate(model.eval(), tokenizer, val_texts, val)
        print(f"{label}: {scores[label]:.1%} right first calls", flush=True)

    ours_curve = [
        (r["elapsed_s"] / 60, r["rollouts/right_tool_call"])
        for r in rows
        if r.get("split") == "rollouts" and "rollouts/right_tool_call" in r and "elapsed_s" in r
    ]
    figure, axis = plt.subplots(figsize=(7, 4))
    for label, points in [
        ("journeyman demo (LangGraph agent, multi-turn)", ours_curve),
        ("TRL GRPOTrainer (single turn)", curve),
    ]:
        if points:
            axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
    axis.set_xlabel("training minutes")
    axis.set_ylabel("rollouts calling the right tool with the right numbers")
    axis.legend()
    figure.tight_layout()
    figure.savefig(PNG, dpi=120)

    print(
        f"### Learning per minute: the demo vs TRL GRPOTrainer on the single-turn form ({machine()})\n\n"
        + table(
            ["", "training minutes", "steps", "held-out right first calls (HF generate, T=0.7)"],
            [
                ("base model", "-", "-", f"{scores['base model']:.0%}"),
                ("TRL GRPOTrainer", f"{trl_minutes:.1f}", len(curve), f"{scores['TRL GRPOTrainer']:.0%}"),
                (
                    "journeyman demo, same minutes",
                    f"<= {trl_minutes:.1f}",
                    our_step,
                    f"{scores['journeyman demo']:.0%}",
                ),
            ],
        )
        + f"\n\n![learning per minute]({PNG.name})\n"
    )


if __name__ == "__main__":
    main()
