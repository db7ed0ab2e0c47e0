"""Checked by mypy --strict (scripts/typecheck.sh): ``jm.LocalBackend`` and ``jm.trainable`` load
through entry points at run time, yet type checkers and IDEs see their real types, not ``Any``."""

from __future__ import annotations

from typing import assert_type

import journeyman as jm
from journeyman.backend import LocalBackend
from journeyman.backend.local import LocalBackend as Defined

assert_type(jm.LocalBackend, type[LocalBackend])  # an Any here is an error: "is of type Any"
assert_type(LocalBackend, type[Defined])
# Were jm.trainable Any, this assignment would pass and its ignore would be unused: an error too.
not_a_number: int = jm.trainable  # type: ignore[assignment]
