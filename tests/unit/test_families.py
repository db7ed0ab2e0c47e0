"""Serving settings chosen from the model folder: parser, template, and the vLLM command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from journeyman.backend.models import TOOL_TEMPLATE
from journeyman.backend.serving.families import TOOL_PARSER_PLUGIN, serving_defaults
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer

QWEN_LIKE = "{%- if tools %}<tools>{{ tools }}</tools>{%- endif %}<tool_call>\n{...}\n</tool_call>"
MISTRAL_LIKE = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}{%- endif %}[TOOL_CALLS]"


def _folder(tmp_path: Path, model_type: str, *, own: str | None = None, ours: str | None = None) -> Path:
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if own is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": own}))
    if ours is not None:
        (folder / TOOL_TEMPLATE).write_text(ours)
    return folder


def test_a_model_whose_template_speaks_hermes_tags_gets_the_tolerant_parser(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "qwen2", own=QWEN_LIKE)
    defaults = serving_defaults(folder)
    assert (defaults.tool_parser, defaults.chat_template, defaults.model_type) == (
        "journeyman",
        None,
        "qwen2",
    )


def test_our_template_wins_over_the_models_own(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama", own="{{ messages }}", ours=QWEN_LIKE)
    defaults = serving_defaults(folder)
    assert defaults.chat_template == folder / TOOL_TEMPLATE and defaults.tool_parser == "journeyman"


def test_a_mistral_template_gets_mistrals_parser(tmp_path: Path) -> None:
    assert serving_defaults(_folder(tmp_path, "mistral", own=MISTRAL_LIKE)).tool_parser == "mistral"


def test_transformers_5_template_file_is_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama")
    (folder / "chat_template.jinja").write_text("{{- '<|python_tag|>' }}")
    assert serving_defaults(folder).tool_parser == "llama3_json"


def test_a_hub_name_gets_the_hermes_compatible_default() -> None:
    defaults = serving_defaults("Qwen/Qwen2.5-0.5B-Instruct")
    assert (defaults.tool_parser, defaults.chat_template, defaults.model_type) == ("journeyman", None, None)


@pytest.mark.parametrize(
    ("tool_parser", "expected"),
    [("auto", "journeyman"), ("hermes", "hermes"), (None, None)],
)
def test_the_command_line_follows_the_choice(
    tmp_path: Path, tool_parser: str | None, expected: str | None
) -> None:
    folder = _folder(tmp_path, "qwen2", own=QWEN_LIKE)
    server = VLLMServer(VLLMConfig(model=folder, port=1, tool_parser=tool_parser), log_path=tmp_path / "log")
    command = server.command()
    assert "--chat-template" not in command  # the tokenizer's own template
    if expected is None:
        assert "--tool-call-parser" not in command and "--enable-auto-tool-choice" not in command
        return
    assert command[command.index("--tool-call-parser") + 1] == expected
    assert ("--tool-parser-plugin" in command) == (expected == "journeyman")
    if expected == "journeyman":
        assert command[command.index("--tool-parser-plugin") + 1] == str(TOOL_PARSER_PLUGIN)


def test_a_chosen_template_is_passed_to_vllm(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "llama", ours=QWEN_LIKE)
    command = VLLMServer(VLLMConfig(model=folder, port=1), log_path=tmp_path / "log").command()
    assert command[command.index("--chat-template") + 1] == str(folder / TOOL_TEMPLATE)
    custom = tmp_path / "mine.jinja"
    config = VLLMConfig(model=folder, port=1, chat_template=custom)
    command = VLLMServer(config, log_path=tmp_path / "log").command()
    assert command[command.index("--chat-template") + 1] == str(custom)


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [("fma avx2", "cpu", "float32"), ("avx2 avx512f avx512_bf16", "cpu", "bfloat16"),
     ("avx2 amx_bf16 amx_tile", "cpu", "bfloat16"), ("fma avx2", "cuda", "bfloat16")],
)  # fmt: skip
def test_the_serving_dtype_follows_the_hardware(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: str, device: str, expected: str
) -> None:
    """bf16 is emulated on CPUs without AVX512-BF16 or AMX (7x slower than fp32 there): float32."""
    import journeyman.backend.serving.vllm as vllm

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu {flags}\n\n")
    real = vllm.cpu_has_bf16
    monkeypatch.setattr(vllm, "cpu_has_bf16", lambda: real(cpuinfo))
    folder = _folder(tmp_path, "llama", ours=QWEN_LIKE)
    server = VLLMServer(VLLMConfig(model=folder, port=1, device=device), log_path=tmp_path / "log")
    command = server.command()
    assert server.dtype == expected and command[command.index("--dtype") + 1] == expected
    config = VLLMConfig(model=folder, port=1, device=device, dtype="float16")
    command = VLLMServer(config, log_path=tmp_path / "log").command()
    assert command[command.index("--dtype") + 1] == "float16"  # a choice is kept
