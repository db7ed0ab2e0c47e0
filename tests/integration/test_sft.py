"""Supervised runs through the real :class:`Trainer` on the embedded model (fp32): the loss is the
hand-computed mean NLL of the assistant tokens, a run lowers it and leaves the base weights, an RL
step goes on from its adapter, bad data stops it before anything trains, the validation loss stops
it early and keeps the best weights, and a conversation put under another prompt keeps its tokens."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import journeyman as jm
from journeyman.backend.training.sft import sft_conversations
from journeyman.backend.training.trainer import ADAPTER, Trainer
from journeyman.errors import InvalidDataError
from journeyman.sft import read_chat_jsonl, with_context
from journeyman.store import ModelStore

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def trainer(folder: Path) -> Trainer:
    result = Trainer("smollm2-135m", ModelStore("test", "sft", root=folder), threads=2, precision="fp32")
    result.load()
    return result


def conversation(question: str, answer: str, *, worked: bool = False) -> jm.Trajectory:
    """A user question and the assistant's answer (a model turn, trained); ``worked``: a worked
    example before it (context, not trained)."""
    items: list[Any] = [{"role": "system", "content": "Answer briefly."}]
    if worked:
        items += [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "2"}]
    items += [
        {"role": "user", "content": question},
        {"type": "model_turn", "message": {"role": "assistant", "content": answer}},
    ]
    return jm.Trajectory(conversation=items)


def hand_nll(model: Any, tokenizer: Any, trajectory: jm.Trajectory) -> tuple[float, int]:
    """Summed NLL of the last assistant turn's tokens and their count, from a plain forward pass
    of the whole conversation rendered by the chat template (no packing, no masks of ours)."""
    messages = trajectory.openai_messages()
    prompt = tokenizer.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert full[: len(prompt)] == prompt
    completion = full[len(prompt) :]
    completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logprobs = torch.log_softmax(logits[0, :-1], dim=-1)
    targets = ids[0, 1:]
    picked = logprobs[torch.arange(len(targets)), targets][len(prompt) - 1 :]
    return -float(picked.sum()), len(completion)


def test_the_loss_is_the_mean_nll_of_the_trained_tokens_and_a_run_lowers_it(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    data = [
        conversation("What is 2+3?", "5"),
        conversation("Name a colour.", "Blue is a colour I like.", worked=True),
    ]
    nll = [hand_nll(t.model, t.tokenizer, d) for d in data]
    before = sum(n for n, _ in nll) / sum(k for _, k in nll)  # per token over the batch, not per conversation
    base = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    config = jm.SFTConfig(
        learning_rate=1e-3, batch_size=2, epochs=4, schedule="constant", micro_batch_tokens=64
    )
    counts: Counter[str] = Counter()
    conversations = sft_conversations(data, t.tokenizer, config, 8192, counts)
    # only the model turns train: the worked example's "2" is context
    assert [c.targets for c in conversations] == [k for _, k in nll]
    assert counts["data/retokenized_turns"] == 2 and counts["data/model_turns"] == 2

    result, rows = t.sft_step(data, [], config)
    assert result.step == 1 == t.step
    assert rows[0]["sft/loss"] == pytest.approx(before, rel=1e-4)  # the first batch's, before its update
    assert [r["sft/batch"] for r in rows] == [1, 2, 3, 4] and rows[-1]["sft/epoch"] == 4
    after = [hand_nll(t.model, t.tokenizer, d) for d in data]
    assert all(a < b for (a, _), (b, _) in zip(after, nll, strict=True))  # each answer likelier
    assert result.metrics["sft/trained_tokens"] == 4 * sum(k for _, k in nll)
    for name, parameter in t.model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name  # the base weights are left as they were
    state = json.loads((t.store.checkpoint_path(1) / "trainer_state.json").read_text())
    assert state["split"] == "sft" and state["metrics"]["sft/batches"] == 4


def test_an_rl_step_after_sft_starts_from_its_adapter_and_a_restart_resumes_there(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    asyncio.run(t.train_sft([conversation("What is 2+3?", "5")], jm.SFTConfig(learning_rate=1e-3, epochs=2)))
    sft_adapter = (t.store.checkpoint_path(1) / ADAPTER / "adapter_model.safetensors").read_bytes()
    rows = t.store.read_history()
    assert [r["split"] for r in rows] == ["sft_batch", "sft_batch", "sft"] and {r["step"] for r in rows} == {
        1
    }
    assert t.store.load_groups("sft", 0)[0].trajectories[0].openai_messages()[-1]["content"] == "5"

    weights = {n: p.detach().clone() for n, p in t._trainable()}
    again = trainer(tmp_path)  # a new process: it loads the SFT step's adapter
    assert again.step == 1
    assert all(torch.equal(p, weights[n]) for n, p in again._trainable())
    group = jm.TrajectoryGroup([conversation("What is 2+3?", "5"), conversation("What is 2+3?", "6")], id="g")
    group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
    result = asyncio.run(again.train([group], jm.TrainConfig(learning_rate=1e-3)))
    assert result.step == 2
    moved = [not torch.equal(p, weights[n]) for n, p in again._trainable()]
    assert any(moved)  # trained on from the SFT adapter, which checkpoint 1 still holds
    assert (
        again.store.checkpoint_path(1) / ADAPTER / "adapter_model.safetensors"
    ).read_bytes() == sft_adapter


def test_bad_data_is_named_and_nothing_trains(tmp_path: Path) -> None:
    lines = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        "not json",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "mul", "arguments": "{}"}}]}], "tools": TOOLS},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zz", "content": "4"},
                      {"role": "assistant", "content": "4"}]},
    ]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(InvalidDataError) as caught:
        read_chat_jsonl(path)
    text = str(caught.value)
    assert "data.jsonl line 2: not JSON" in text
    assert "data.jsonl line 3: no assistant turn to learn from" in text
    assert (
        "data.jsonl line 4: a tool call to 'mul', which the conversation does not declare (tools: add)"
        in text
    )
    assert "data.jsonl line 5: a tool result for call 'zz'" in text
    assert "line 1" not in text

    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}) + "\n")  # fmt: skip
    data = read_chat_jsonl(path)
    t = trainer(tmp_path)
    with pytest.raises(
        InvalidDataError, match=r"data\.jsonl line 2: \d+ tokens, more than 256 \(max_seq_len 256"
    ):
        asyncio.run(t.train_sft(data, jm.SFTConfig(max_seq_len=256)))
    assert t.step == 0 and t.store.latest_checkpoint() == (0, t.store.checkpoint_path(0))
    assert t.store.read_history() == []
    result = asyncio.run(t.train_sft(data, jm.SFTConfig(max_seq_len=256, overlong="exclude")))
    assert result.metrics["sft/conversations"] == 1 and result.metrics["data/excluded_conversations"] == 1


def test_the_validation_loss_stops_a_run_early_and_the_best_weights_are_kept(tmp_path: Path) -> None:
    train = [conversation("Which colour is the sky?", "Green, always green.")]
    held = [conversation("Which colour is the sky?", "Blue.")]
    config = jm.SFTConfig(learning_rate=3e-3, epochs=6, schedule="constant", early_stopping_patience=1)
    t = trainer(tmp_path / "a")
    result, rows = t.sft_step(train, held, config)
    losses = [r["sft/val_loss"] for r in rows]
    assert result.metrics["sft/stopped_early"] == 1 and len(rows) < 6
    best = min(range(len(losses)), key=losses.__getitem__)
    assert losses[-1] > losses[best] and result.metrics["sft/best_batch"] == best + 1
    assert result.metrics["sft/val_loss"] == losses[best]
    # The saved adapter is the best batch's: a run that stops there saves the same bytes.
    short = trainer(tmp_path / "b")
    short.sft_step(train, [], config.model_copy(update={"epochs": best + 1, "early_stopping_patience": None}))
    assert (t.store.checkpoint_path(1) / ADAPTER / "adapter_model.safetensors").read_bytes() == (
        short.store.checkpoint_path(1) / ADAPTER / "adapter_model.safetensors"
    ).read_bytes()


def test_turns_put_under_another_prompt_keep_their_sampled_tokens_and_drift_is_counted(
    tmp_path: Path,
) -> None:
    t = trainer(tmp_path)
    tokenizer = t.tokenizer
    sampled = conversation("What is 2+3?", "5", worked=True)
    messages = sampled.openai_messages()
    prompt = tokenizer.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    completion = full[len(prompt) : full.index(tokenizer.eos_token_id, len(prompt)) + 1]
    turn = sampled.conversation[-1]
    sampled.conversation[-1] = turn.model_copy(
        update={"prompt_token_ids": prompt, "completion_token_ids": completion}
    )

    zero_shot = with_context(sampled, [{"role": "system", "content": "Use the tools."}])
    assert [m["role"] for m in zero_shot.openai_messages()] == ["system", "user", "assistant"]
    assert zero_shot.conversation[-1].completion_token_ids == completion
    assert sampled.conversation[-1].prompt_token_ids == prompt  # the original is not changed
    counts: Counter[str] = Counter()
    (only,) = sft_conversations([zero_shot], tokenizer, jm.SFTConfig(), 8192, counts)
    (sequence,) = only.sequences
    assert [tok for tok, m in zip(sequence.tokens, sequence.mask, strict=True) if m] == completion
    assert counts["data/recontextualized_turns"] == 1 and counts["data/drifted_turns"] == 0

    # Sampled tokens that the template would not render for the turn's text: drift, counted,
    # and the sampled tokens are what trains.
    other = [*tokenizer("five", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    drifted = zero_shot.model_copy(deep=True)
    drifted.conversation[-1] = drifted.conversation[-1].model_copy(update={"completion_token_ids": other})
    counts.clear()
    (only,) = sft_conversations([drifted], tokenizer, jm.SFTConfig(), 8192, counts)
    assert counts["data/drifted_turns"] == 1
    assert [
        tok for tok, m in zip(only.sequences[0].tokens, only.sequences[0].mask, strict=True) if m
    ] == other


def test_the_sft_command_learns_from_jsonl_and_from_a_runs_best_groups(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from journeyman.backend.app.cli import app
    from journeyman.sft import write_chat_jsonl

    data = write_chat_jsonl(
        [conversation(f"What is {n}+1?", str(n + 1)) for n in range(4)], tmp_path / "d.jsonl"
    )
    run = ModelStore("demo", "earlier", root=tmp_path)
    group = jm.TrajectoryGroup([conversation("What is 2+2?", "4"), conversation("What is 2+2?", "5")])
    group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
    run.save_groups([group], "train", 0)
    command = ["sft", "test", "taught", "--data", str(data), "--from-run", "demo/earlier", "--epochs", "2",
               "--batch-size", "2", "--eval-fraction", "0.2", "--root", str(tmp_path)]  # fmt: skip
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "demo/earlier: 1 trajectories from 1 train groups" in result.output
    assert "5 conversations" in result.output and "step 1: 4 batches" in result.output
    store = ModelStore("test", "taught", root=tmp_path)
    (kept,) = store.load_groups("sft", 0)
    answers = sorted(t.openai_messages()[-1]["content"] for t in kept)
    assert "4" in answers and "5" not in answers  # the run's best only; one of the five held out
    assert len(answers) == 4 and store.load_groups("sft_eval", 0)
    missing = CliRunner().invoke(app, ["sft", "test", "taught", "--root", str(tmp_path)])
    assert missing.exit_code != 0 and "give --data FILE.jsonl" in str(missing.exception)
