#!/usr/bin/env bash
# mypy checks the import package `journeyman`, whose parts live in three top-level folders
# (core/ -> journeyman, integrations/ -> journeyman.integrations, backend/ -> journeyman.backend).
# Lay them out as one package tree of symlinks so mypy sees the real module names.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/journeyman"
for file in core/*.py core/py.typed; do ln -s "../../../$file" "$tree/journeyman/"; done
ln -s ../../../integrations "$tree/journeyman/integrations"
ln -s ../../../backend "$tree/journeyman/backend"
MYPYPATH=$tree "${VENV:-.venv}/bin/mypy" -p journeyman "$@"
# The names `jm` loads through entry points are typed for users' type checkers (no Any).
MYPYPATH=$tree exec "${VENV:-.venv}/bin/mypy" --strict --follow-imports=silent tests/typing/public_api.py
