"""The GPU check: ``make gpu-check`` (``python scripts/gpu_check.py run``) on a CUDA machine.

Two parts, one command, each printing its table and what it skipped (``tests/gpu`` holds the
assertions, ``tests/gpu/checks.py`` the measurements):

* the trainer part, for any CUDA machine, one with no network and none of journeyman's other
  dependencies included: the real architectures (Qwen2 at 0.5B and 1.5B, Llama at SmolLM2-135M)
  built from their configs with random weights; parameters and every tensor of a step on the GPU;
  a step per engine present (seconds, peak memory, share of the GPU's bf16 peak); packed against
  unpacked logprobs on a 2650-token shared-prefix row; resume then a step; TRL's step on the same
  batch where TRL imports;
* the serving part, for a full CUDA set-up (``make setup`` installed CUDA vLLM): the policy and a
  1.5B judge served beside the trainer under the memory plan, sleep and wake, and the trainer's
  logprobs against vLLM's on the same tokens.

On a machine with torch, transformers, peft and accelerate but not journeyman,
``python scripts/gpu_check.py prepare`` (run first on a machine with the project set up) leaves in
``build/gpu-check`` the small wheels journeyman's trainer imports (journeyman itself built from
this working tree, pydantic, httpx, pytest; for the target's Python) and the tokenizers' files;
``run`` installs them with ``--no-deps`` into ``build/gpu-check/site`` when ``import journeyman``
fails. ``run --cpu`` runs the trainer part on the CPU with a tiny model.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "gpu-check"
# What `import journeyman` and the trainer need beyond torch, transformers, peft and accelerate,
# and pytest: pure Python but pydantic-core
WHEELS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "httpx", "httpcore",
    "h11", "anyio", "sniffio", "certifi", "idna", "pytest", "pluggy", "iniconfig", "packaging", "safetensors",
)  # fmt: skip


def prepare(python_version: str) -> None:
    """Tokenizer files and wheels into build/gpu-check (about 20 MB), for a machine without network."""
    from importlib.metadata import version

    from journeyman.backend.models import prepare_model

    sys.path.insert(0, str(ROOT))
    from tests.gpu.checks import TOKENIZER_SOURCES, copy_tokenizer

    for name, alias in TOKENIZER_SOURCES.items():
        copy_tokenizer(prepare_model(alias), BUILD / "tokenizers" / name)
    wheels = BUILD / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
         "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", str(wheels), *pins],
        check=True,
    )  # fmt: skip
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True
    )
    size = sum(f.stat().st_size for f in BUILD.rglob("*") if f.is_file() and "site" not in f.parts)
    print(
        f"prepared {BUILD} ({size / 2**20:.1f} MiB): {len(list(wheels.iterdir()))} wheels, tokenizers {list(TOKENIZER_SOURCES)}"
    )


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "unsloth", "trl", "journeyman"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except Exception as error:  # absent, or a broken install: say which
            found[name] = "absent" if isinstance(error, ModuleNotFoundError) else f"fails: {error}"
    import torch

    found["cuda"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        found["gpu"] = (
            f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"
        )
    try:
        from journeyman.backend.settings import vllm_python

        python = vllm_python()
        done = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
        )
        found["vllm"] = done.stdout.strip() if done.returncode == 0 else f"absent ({python})"
    except Exception as error:
        found["vllm"] = f"absent ({type(error).__name__})"
    return found


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value).replace("\n", "<br>")

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def run(cpu: bool, out: Path, pytest_args: list[str]) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JOURNEYMAN_GPU_CHECK_OUT": str(out)}
    if cpu:
        env["JOURNEYMAN_GPU_CHECK_DEVICE"] = "cpu"
    if (BUILD / "tokenizers").is_dir():
        env["JOURNEYMAN_GPU_CHECK_TOKENIZERS"] = str(BUILD / "tokenizers")
    if importlib.util.find_spec("journeyman") is None:
        site, wheels = BUILD / "site", sorted((BUILD / "wheels").glob("*.whl"))
        if not wheels:
            sys.exit(
                "journeyman is not installed here: run `python scripts/gpu_check.py prepare` where it is"
            )
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
             *map(str, wheels)],
            check=True,
        )  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        sys.path.insert(0, str(site))
    print("## Versions\n")
    print(table([versions()]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "--confcutdir", "tests/gpu",
               "-rs", "-q", "-W", "ignore::pytest.PytestConfigWarning", *pytest_args]  # fmt: skip
    print(f"\n## Tests\n\n$ {' '.join(command[2:])}", flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    for name, rows in results.items():
        print(f"\n## {name}\n\n{table(rows)}")
    if not results:
        print("\nno measurements: every test skipped (see the reasons above)")
    return done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("prepare", help="wheels and tokenizer files for a machine without network")
    ready.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    check = commands.add_parser("run", help="run the check and print its tables")
    check.add_argument("--cpu", action="store_true", help="the trainer part on the CPU, with a tiny model")
    check.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or BUILD), help="where results.json goes"
    )
    arguments, rest = parser.parse_known_args()
    if arguments.command == "prepare":
        prepare(arguments.python_version)
    else:
        sys.exit(run(arguments.cpu, arguments.out, rest))


if __name__ == "__main__":
    main()
