"""The embedded default model, prepared from the wheel's GGUF, loaded with real transformers."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from journeyman.backend.models import MARKER, TOOL_TEMPLATE, prepare_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {"type": "object"},
        },
    },
]


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# A 3-turn tool conversation: call a tool, call another with the first result, then answer.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful calculator. Use the tools."},
    {"role": "user", "content": "What is (2+3)*4?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c1", "add", '{"a": 2, "b": 3}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {
        "role": "assistant",
        "content": "Now multiply.",
        "tool_calls": [_call("c2", "multiply", '{"a": 5, "b": 4}')],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "20"},
    {"role": "assistant", "content": "The answer is 20."},
]


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir)


def test_folder_is_a_complete_bf16_model(model_dir: Path, model: Any) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        MARKER,
        TOOL_TEMPLATE,
    } <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)
    assert "quantization_config" not in config
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_prepare_again_is_a_no_op(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_model("smollm2-135m", model_dir.parent) == model_dir
    assert weights.stat().st_mtime_ns == before


def test_greedy_answer_to_two_plus_three_is_five(model: Any, tokenizer: Any) -> None:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


def test_tools_appear_in_the_rendered_prompt(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "What is 2+3?"}]
    with_tools = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for tool in TOOLS:
        assert json.dumps(tool["function"]) in with_tools
    assert "<tool_call>" in with_tools and "<tools>" in with_tools
    assert "<tools>" not in without
    # The model's own default system prompt is kept when the conversation has none.
    assert without.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert without.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_calls_and_results_render_hermes_style(tokenizer: Any) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
        in text
    )
    assert (
        'Now multiply.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 5, "b": 4}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    # Arguments given as a dict (as vLLM passes them to the template) render the same way.
    as_dicts = [
        {
            **m,
            "tool_calls": [
                _call(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in CONVERSATION
    ]
    assert tokenizer.apply_chat_template(as_dicts, tools=TOOLS, tokenize=False) == text


def test_parallel_tool_results_share_one_user_turn(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "2+3 and 2*3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("a", "add", "{}"), _call("b", "multiply", "{}")],
        },
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "6"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "</tool_call>\n<tool_call>" in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
    )


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True, **kwargs)[
        "input_ids"
    ]
    return list(ids)


def test_each_turn_is_a_token_prefix_of_the_next_prompt(tokenizer: Any) -> None:
    """What multi-turn training relies on: prompt_k + completion_k is a prefix of prompt_{k+1}."""
    assistant_positions = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    assert len(assistant_positions) == 3
    turns = []
    for position in assistant_positions:
        prompt = _render(tokenizer, CONVERSATION[:position], add_generation_prompt=True)
        # What the model samples: the rendered assistant turn after the generation prompt,
        # up to and including <|im_end|> (vLLM keeps the end-of-turn token in the completion).
        full = _render(tokenizer, CONVERSATION[: position + 1])
        assert full[: len(prompt)] == prompt
        completion = full[len(prompt) :]
        end = completion.index(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        turns.append((prompt, completion[: end + 1]))
    for (prompt, completion), (next_prompt, _) in itertools.pairwise(turns):
        sampled = prompt + completion
        assert next_prompt[: len(sampled)] == sampled
        assert len(next_prompt) > len(sampled)
    # The sampled tool call decodes to exactly what the hermes parser reads back.
    first_completion = tokenizer.decode(turns[0][1])
    assert (
        first_completion
        == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    )
