#!/usr/bin/env bash
# SkyPilot in an environment of its own, idempotently (scripts/setup.sh runs this; so does
# `make skypilot-env`): $JOURNEYMAN_SKYPILOT_VENV, default $JOURNEYMAN_HOME/venvs/skypilot, built
# from requirements/skypilot.txt. SkyPilot cannot share the main environment (it requires click<8.2
# and uvicorn<0.36). The environment launches the recipe in deploy/skypilot, and
# tests/integration/test_skypilot_recipe.py checks the recipe with it.
#   scripts/skypilot-env.sh          build it, or do nothing when it is up to date
#   scripts/skypilot-env.sh --path   print where it is (whether built or not)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOURNEYMAN_HOME=${JOURNEYMAN_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/journeyman}
SKYPILOT_VENV=${JOURNEYMAN_SKYPILOT_VENV:-$JOURNEYMAN_HOME/venvs/skypilot}
REQUIREMENTS=requirements/skypilot.txt

if [[ ${1:-} == --path ]]; then
    echo "$SKYPILOT_VENV"
    exit 0
fi

quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

stamp=$(cat "$REQUIREMENTS" <("$PYTHON" --version) | sha256sum | cut -c1-16)
if [[ -f "$SKYPILOT_VENV/.journeyman-stamp" && "$(cat "$SKYPILOT_VENV/.journeyman-stamp")" == "$stamp" ]] \
    && "$SKYPILOT_VENV/bin/python" -c "import sky" 2>/dev/null; then
    log "SkyPilot environment $SKYPILOT_VENV is up to date"
    exit 0
fi
log "creating the SkyPilot environment in $SKYPILOT_VENV from $REQUIREMENTS (under a minute, about 460 MB)"
rm -rf "$SKYPILOT_VENV"
"$PYTHON" -m venv "$SKYPILOT_VENV"
quiet_pip "$SKYPILOT_VENV/bin/python" -m pip install -q --upgrade pip
quiet_pip "$SKYPILOT_VENV/bin/python" -m pip install -q -r "$REQUIREMENTS"
"$SKYPILOT_VENV/bin/python" -c "import sky"
echo "$stamp" > "$SKYPILOT_VENV/.journeyman-stamp"
