"""What a run's files must say after any interruption, checked from the files alone.

``journeyman check RUN_DIR`` (or :func:`check_run`) reads one model's store and the gateway's
records beside it, and lists every broken promise:

- the checkpoints are steps 0..N with none missing, each complete (its trainer state readable);
- the history has one ``train`` row per completed step, 1..N;
- the training trajectories are stored for steps 0..N-1 (file ``k`` trained checkpoint ``k+1``),
  each file readable to its end; a file for step N is a step that has not finished (the trainer
  sets it aside as ``interrupted`` when it starts again), reported apart, not as a fault;
- no model turn was trained on twice (its completion id in two stored training groups);
- every completion the gateway recorded is recorded once, and every token-exact turn trained on
  has its record;
- no temporary file or folder is left visible (a half-written file keeps a hidden name);
- the step the plain name serves has its checkpoint (while training promotes each step it
  finishes, that is the latest, even when the process died before recording the promotion);
- ``max_off_policy=K``: each turn trained at step ``k`` was answered by version ``k - K`` or newer;
  ``K = 0`` (``on_policy``) is a run that samples and trains in turn, like the demo: the served
  version was the latest checkpoint when each turn was sampled. A run whose rollouts overlap
  training samples up to ``K`` versions behind by design.

Hidden leftovers of a write that was killed (``.0003.*.tmp``) are counted, not faults: readers
never see them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from journeyman.errors import InvalidDataError
from journeyman.store import CHECKPOINT_STATE, ModelStore

__all__ = ["RunCheck", "check_run"]


@dataclass
class RunCheck:
    """What :func:`check_run` found: ``problems`` is empty when every promise holds."""

    run_dir: Path
    latest_step: int | None = None
    trained_steps: int = 0
    trained_groups: int = 0
    records: int = 0
    unfinished_step: int | None = None
    """A step whose groups are stored and not trained yet (the run stopped during it)."""
    hidden_leftovers: int = 0
    stale_turns: int = 0
    """Trained turns sampled from an older version than the step that trained them."""
    most_off_policy: int = 0
    """The most versions a trained turn was behind its step (0: every turn on-policy)."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_run(
    run_dir: Path,
    records: Path | None = None,
    *,
    on_policy: bool = False,
    max_off_policy: int | None = None,
) -> RunCheck:
    """Check the run in ``run_dir`` (``ROOT/PROJECT/NAME``) and the gateway's records (default:
    ``ROOT/gateway/completions.jsonl`` when it exists); ``max_off_policy=K``: a trained turn more
    than ``K`` versions behind its step is a problem (``on_policy`` is ``K = 0``)."""
    if on_policy:
        max_off_policy = 0 if max_off_policy is None else min(max_off_policy, 0)
    if max_off_policy is not None and max_off_policy < 0:
        raise InvalidDataError(f"max_off_policy must be 0 or more, got {max_off_policy}")
    store = ModelStore.from_path(run_dir)
    if not store.path.is_dir():
        raise InvalidDataError(f"{run_dir} is not a run folder (ROOT/PROJECT/NAME)")
    check = RunCheck(run_dir=store.path)
    steps = store.checkpoint_steps()
    check.latest_step = steps[-1] if steps else None
    if steps and steps != list(range(steps[-1] + 1)):
        check.problems.append(f"checkpoints {steps} skip a step")
    for step in steps:
        try:
            json.loads((store.checkpoint_path(step) / CHECKPOINT_STATE).read_text())
        except (OSError, ValueError) as error:
            check.problems.append(f"checkpoint {step} is incomplete: {error}")
    latest = check.latest_step or 0
    rows = Counter(int(r["step"]) for r in store.read_history() if r.get("split") == "train")
    check.trained_steps = len(rows)
    if sorted(rows) != list(range(1, latest + 1)) or any(n > 1 for n in rows.values()):
        check.problems.append(
            f"the history's train rows are for steps {sorted(rows.elements())}, not once each for 1..{latest}"
        )
    served = store.promoted_step()
    if served is not None and served not in steps:
        check.problems.append(f"the plain name serves step {served}, which has no checkpoint")
    trained = _check_trajectories(store, latest, check)
    records = records if records is not None else store.root / "gateway" / "completions.jsonl"
    if records.is_file():
        _check_records(records, trained, check)
    if max_off_policy is not None and check.most_off_policy > max_off_policy:
        check.problems.append(
            f"{check.stale_turns} trained turns were answered by an older version than their step's, "
            f"up to {check.most_off_policy} versions behind (at most {max_off_policy} allowed)"
        )
    for path in store.path.rglob("*"):
        hidden = any(part.startswith(".") for part in path.relative_to(store.path).parts)
        if hidden and (path.name.endswith(".tmp") or ".tmp" in path.name):
            check.hidden_leftovers += 1
        elif not hidden and path.name.endswith(".tmp"):
            check.problems.append(f"a temporary file is visible: {path}")
    return check


def _check_trajectories(store: ModelStore, latest: int, check: RunCheck) -> dict[str, int]:
    """Check the stored training groups; return the completion ids of the token-exact turns
    trained on, each with the step that trained it."""
    stored = store.steps("train")
    expected = list(range(latest))
    if [s for s in stored if s < latest] != expected:
        missing = sorted(set(expected) - set(stored))
        check.problems.append(
            f"trained steps without their stored trajectories: files for steps {missing} missing"
        )
    extra = [s for s in stored if s > latest]
    if latest in stored:
        check.unfinished_step = latest
    if extra:
        check.problems.append(f"trajectories stored for steps {extra}, beyond the latest checkpoint {latest}")
    seen: Counter[str] = Counter()
    steps: dict[str, int] = {}
    for step in (s for s in stored if s < latest):
        try:
            groups = store.load_groups("train", step)
        except InvalidDataError as error:
            check.problems.append(f"train step {step}: {error}")
            continue
        check.trained_groups += len(groups)
        ids = [
            turn.completion_id
            for group in groups
            for trajectory in group
            for history in trajectory.histories
            for turn in history.model_turns
            if turn.completion_id is not None and turn.is_token_exact
        ]
        seen.update(ids)
        steps |= dict.fromkeys(ids, step)
    twice = [cid for cid, n in seen.items() if n > 1]
    if twice:
        check.problems.append(f"{len(twice)} model turns were trained on more than once: {twice[:3]}")
    return steps


def _check_records(records: Path, trained: dict[str, int], check: RunCheck) -> None:
    ids: Counter[str] = Counter()
    with records.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids[record["completion_id"]] += 1
            except (ValueError, KeyError):
                if line.endswith("\n"):  # a last line without its newline is a write cut short
                    check.problems.append(f"{records}, line {number}: not a completion record")
                continue
            step = trained.get(record["completion_id"])
            version = record.get("policy_version")
            if step is not None and version is not None and version != step:
                check.stale_turns += 1
                check.most_off_policy = max(check.most_off_policy, step - version)
    check.records = sum(ids.values())
    twice = [cid for cid, n in ids.items() if n > 1]
    if twice:
        check.problems.append(f"{len(twice)} completions are recorded more than once: {twice[:3]}")
    missing = sorted(set(trained) - set(ids))
    if missing:
        check.problems.append(f"{len(missing)} trained turns have no gateway record: {missing[:3]}")
