"""Gated promotion: the router serves a candidate beside the promoted step, moves the plain name
only when told, never unloads the promoted step; the store records every move; the gate decides
from the caller's evaluation; the commands move and list by hand."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import journeyman as jm
from journeyman.backend.app.cli import app
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig
from journeyman.errors import ConfigError, InvalidDataError
from journeyman.gate import Gate, GateDecision, promote_canary_if_better, promote_if_better
from journeyman.store import ModelStore
from tests.scripted_upstream import ScriptedServer


class AdapterServer(ScriptedServer):
    """Records adapter loads and unloads."""

    def __init__(self, tmp_path: Path, *, merged: bool = False) -> None:
        super().__init__("http://127.0.0.1:9", log_dir=tmp_path)
        self.config = VLLMConfig(model="scripted", served_name="base", merge_adapters=merged)
        self.loaded: list[str] = []
        self.events: list[str] = []

    async def load_adapter(self, name: str, path: Path, client: Any = None) -> None:
        self.loaded.append(name)
        self.events.append(f"load {name}")

    async def unload_adapter(self, name: str, client: Any = None) -> None:
        self.loaded.remove(name)
        self.events.append(f"unload {name}")

    def exit_code(self) -> int | None:
        return None


def test_a_candidate_is_served_beside_the_promoted_step_until_promoted(tmp_path: Path) -> None:
    server = AdapterServer(tmp_path)
    router = Router(server, keep_versions=2)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        assert await router.deploy("agent", tmp_path / "1", 1) == "agent@1"
        assert router.resolve("agent") == ("agent@1", 1)
        assert await router.deploy("agent", tmp_path / "2", 2, promote=False) == "agent@2"
        assert router.resolve("agent") == ("agent@1", 1)  # production stays
        assert router.resolve("agent@2") == ("agent@2", 2)  # the candidate answers by its name
        # More candidates than kept versions: the oldest candidates go, never the promoted step.
        await router.deploy("agent", tmp_path / "3", 3, promote=False)
        await router.deploy("agent", tmp_path / "4", 4, promote=False)
        assert server.loaded == ["agent@1", "agent@4"]
        assert router.resolve("agent") == ("agent@1", 1)
        assert await router.promote("agent", 4, tmp_path / "4") == "agent@4"
        assert router.resolve("agent") == ("agent@4", 4)
        # A rollback to a step no longer loaded loads it again and unloads the oldest other one.
        assert await router.promote("agent", 3, tmp_path / "3") == "agent@3"
        assert router.resolve("agent") == ("agent@3", 3)
        assert server.loaded == ["agent@4", "agent@3"]
        assert await router.promote("agent", 0, None) == "base"
        assert router.resolve("agent") == ("base", 0)

    asyncio.run(scenario())


def test_requests_running_on_the_old_version_finish_before_it_is_unloaded(tmp_path: Path) -> None:
    server = AdapterServer(tmp_path)
    router = Router(server, keep_versions=1)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        await router.deploy("agent", tmp_path / "1", 1)
        served, version = await router.admit("agent")  # a request starts on step 1
        assert (served, version) == ("agent@1", 1)
        await router.deploy("agent", tmp_path / "2", 2, promote=False)
        moving = asyncio.create_task(router.promote("agent", 2, tmp_path / "2"))
        await asyncio.sleep(0.3)
        assert router.resolve("agent") == ("agent@2", 2)  # new requests get step 2 at once
        assert "agent@1" in server.loaded and not moving.done()  # the running one keeps step 1
        router.end(served)
        await asyncio.wait_for(moving, 5)
        assert server.loaded == ["agent@2"]

    asyncio.run(scenario())


def test_merged_serving_refuses_a_candidate_beside_the_promoted_step(tmp_path: Path) -> None:
    router = Router(AdapterServer(tmp_path, merged=True))

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        with pytest.raises(ConfigError, match=r"holds one version at a time.*merge_adapters=False"):
            await router.deploy("agent", tmp_path / "1", 1, promote=False)
        assert router.resolve("agent") == ("base", 0)

    asyncio.run(scenario())


def test_a_canary_gets_its_share_of_rollouts_each_whole(tmp_path: Path) -> None:
    server = AdapterServer(tmp_path)
    router = Router(server, keep_versions=2)

    async def scenario() -> None:
        await router.deploy("agent", None, 0)
        await router.deploy("agent", tmp_path / "1", 1)
        assert await router.set_canary("agent", 2, tmp_path / "2", 0.25) == "agent@2"  # loaded for it
        rollouts = [f"rollout-{i}" for i in range(2000)]
        first = [router.resolve("agent", r)[0] for r in rollouts]
        assert [router.resolve("agent", r)[0] for r in rollouts] == first  # a rollout never switches
        assert 0.22 < first.count("agent@2") / len(first) < 0.28  # binomial sd ~0.01
        assert router.resolve("agent") == ("agent@1", 1)  # no rollout id: production
        assert router.resolve("agent@1", "rollout-1") == ("agent@1", 1)  # a versioned name is exact
        # Neither the promoted step nor the candidate is unloaded for a newer step; nor is the newer one.
        await router.deploy("agent", tmp_path / "3", 3, promote=False)
        assert server.loaded == ["agent@1", "agent@2", "agent@3"]
        await router.promote("agent", 2, tmp_path / "2")  # a promotion ends the canary
        assert router.canaries == {} and {router.resolve("agent", r)[0] for r in rollouts[:50]} == {"agent@2"}
        await router.set_canary("agent", 3, tmp_path / "3", 0.5)
        await router.set_canary("agent", 3, tmp_path / "3", 0)
        assert router.canaries == {}
        with pytest.raises(ConfigError, match="between 0 and 1"):
            await router.set_canary("agent", 3, tmp_path / "3", 1.5)

    asyncio.run(scenario())
    merged = Router(AdapterServer(tmp_path, merged=True))

    async def refused() -> None:
        await merged.deploy("agent", None, 0)
        with pytest.raises(ConfigError, match="a canary serves two versions at once"):
            await merged.set_canary("agent", 1, tmp_path / "1", 0.1)

    asyncio.run(refused())


def _store(tmp_path: Path, steps: range = range(4)) -> ModelStore:
    store = ModelStore("p", "agent", root=tmp_path)
    for step in steps:
        with store.write_checkpoint(step) as folder:
            (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    return store


def test_a_step_whose_promotion_row_was_lost_with_the_process_is_served(tmp_path: Path) -> None:
    """Training promotes each step: killed after step 3's checkpoint, before its row, the name
    still serves step 3 when the run starts again; a pinned step or a gate's hold stays put."""
    store = _store(tmp_path)  # checkpoints 0..3
    for step in (1, 2):
        store.append_promotion({"action": "promote", "step": step, "by": "train"})
    assert store.follows_training() and store.promoted_step() == 3
    store.append_promotion({"action": "promote", "step": 2, "by": "train", "pinned": True})
    assert not store.follows_training() and store.promoted_step() == 2
    store.append_promotion({"action": "promote", "step": 3, "by": "train"})
    store.append_promotion({"action": "hold", "step": 3, "by": "gate"})
    assert not store.follows_training() and store.promoted_step() == 3
    store.append_promotion({"action": "rollback", "step": 1, "by": "me"})
    assert store.promoted_step() == 1


def test_the_store_records_moves_and_keeps_the_promoted_checkpoint(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.promoted_step() is None
    store.append_promotion({"action": "promote", "step": 1, "by": "train"})
    store.append_promotion({"action": "hold", "step": 2, "by": "gate"})
    assert store.promoted_step() == 1  # a hold moves nothing
    store.append_promotion({"action": "rollback", "step": 0, "by": "me"})
    assert store.promoted_step() == 0
    assert [row["action"] for row in store.read_promotions()] == ["promote", "hold", "rollback"]
    assert all("time" in row for row in store.read_promotions())
    with pytest.raises(InvalidDataError, match="needs an action"):
        store.append_promotion({"action": "demote", "step": 1})
    store.append_promotion({"action": "promote", "step": 1, "by": "me"})
    assert store.running_canary() is None
    store.append_promotion({"action": "canary", "step": 2, "share": 0.25, "by": "me"})
    assert store.running_canary() == (2, 0.25)
    assert store.prune_checkpoints(None) == [0]  # the latest (3), the promoted (1), the canary's (2) stay
    store.append_promotion({"action": "canary", "step": 2, "share": 0, "by": "me"})  # ended
    assert store.running_canary() is None
    store.append_promotion({"action": "canary", "step": 2, "share": 0.5, "by": "me"})
    store.append_promotion({"action": "hold", "step": 2, "by": "gate"})  # a decision ends it too
    assert store.running_canary() is None
    assert store.prune_checkpoints(None) == [2]
    assert store.checkpoint_steps() == [1, 3]


class GateBackend:
    """Only what promote_if_better asks of a backend."""

    def __init__(self, promoted: int) -> None:
        self.promoted = promoted
        self.calls: list[tuple[int, str, dict[str, Any] | None]] = []

    async def promoted_step(self, model: Any) -> int:
        return self.promoted

    async def promote(
        self, model: Any, step: int, *, action: str, by: str, gate: dict[str, Any] | None
    ) -> int:
        self.calls.append((step, action, gate))
        if action == "promote":
            self.promoted = step
        return step


def _gated(rewards: dict[str, list[float]], gate: Gate) -> tuple[GateDecision, GateBackend, list[str]]:
    model = jm.TrainableModel(name="agent", project="p", base_model="smollm2-135m")
    backend = GateBackend(promoted=1)
    model._backend = backend  # type: ignore[assignment]
    asked: list[str] = []

    async def evaluate(name: str) -> list[jm.TrajectoryGroup]:
        asked.append(name)
        trajectories = [
            jm.Trajectory(conversation=[{"role": "user", "content": "q"}], reward=r) for r in rewards[name]
        ]
        return [jm.TrajectoryGroup(trajectories)]

    decision = asyncio.run(promote_if_better(model, 2, evaluate, gate))
    return decision, backend, asked


def test_the_gate_promotes_a_better_step_and_holds_a_worse_one() -> None:
    better, backend, asked = _gated({"agent@2": [1, 1, 0, 1], "agent": [0, 1, 0, 0]}, Gate())
    assert asked == ["agent@2", "agent"]  # the candidate by its name, production by the plain name
    assert better.promoted and better.delta == pytest.approx(0.5) and better.samples == (4, 4)
    assert backend.promoted == 2 and backend.calls[0][1] == "promote"
    assert backend.calls[0][2] == better.to_dict()  # the numbers are recorded with the move

    worse, backend, _ = _gated({"agent@2": [0, 0, 1, 0], "agent": [1, 1, 0, 1]}, Gate())
    assert not worse.promoted and worse.delta == pytest.approx(-0.5)
    assert backend.promoted == 1 and backend.calls == [(2, "hold", worse.to_dict())]

    tolerated, backend, _ = _gated({"agent@2": [0.9, 0.9], "agent": [1.0, 1.0]}, Gate(min_delta=-0.2))
    assert tolerated.promoted and backend.promoted == 2


def test_a_canary_is_decided_on_the_rollouts_each_version_answered() -> None:
    model = jm.TrainableModel(name="agent", project="p", base_model="smollm2-135m")
    backend = GateBackend(promoted=1)
    model._backend = backend  # type: ignore[assignment]

    def answered(step: int, reward: float) -> jm.Trajectory:
        q = [{"role": "user", "content": "q"}]
        return jm.Trajectory(conversation=q, reward=reward, final_policy_version=step)

    groups = [jm.TrajectoryGroup([answered(2, 1.0), answered(1, 0.0), answered(1, 1.0), answered(7, 0.0)])]
    decision = asyncio.run(promote_canary_if_better(model, 2, groups))
    assert decision.promoted and decision.samples == (1, 2) and decision.delta == pytest.approx(0.5)
    assert backend.promoted == 2  # step 7's rollout (another version) was left out
    with pytest.raises(ConfigError, match="no trajectory"):
        asyncio.run(promote_canary_if_better(model, 3, groups))


def test_the_gate_needs_enough_scored_samples() -> None:
    with pytest.raises(
        ConfigError, match="needs 5 scored trajectories of agent@2, the evaluation returned 3"
    ):
        _gated({"agent@2": [1, 1, 1], "agent": [0] * 5}, Gate(samples=5))
    decision, _, _ = _gated({"agent@2": [1, 1, 0, 0], "agent": [0, 0, 1, 1]}, Gate(samples=2))
    assert decision.samples == (2, 2) and decision.delta == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="at least 1"):
        Gate(samples=0)


def test_rollbacks_walk_back_through_the_promotions() -> None:
    from journeyman.backend.local import previous_promotion

    rows = [{"action": "promote", "step": s} for s in (0, 1, 2, 3)]
    assert previous_promotion(rows, 3) == 2
    rows.append({"action": "rollback", "step": 2})
    assert previous_promotion(rows, 2) == 1  # a second rollback goes further back, not forward to 3
    rows += [{"action": "rollback", "step": 1}, {"action": "hold", "step": 4}]
    assert previous_promotion(rows, 1) == 0
    with pytest.raises(ConfigError, match="no step was promoted before step 0"):
        previous_promotion([{"action": "promote", "step": 0}], 0)


def test_promote_and_rollback_by_hand_are_recorded_and_listed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for step in (1, 2, 3):
        store.append_promotion({"action": "promote", "step": step, "by": "train"})
    runner = CliRunner()
    rolled = runner.invoke(app, ["rollback", "p", "agent", "--root", str(tmp_path)])
    assert rolled.exit_code == 0, rolled.output
    assert "answers as step 2 from its next registration" in rolled.output
    assert store.promoted_step() == 2
    assert runner.invoke(app, ["promote", "p", "agent", "3", "--root", str(tmp_path)]).exit_code == 0
    assert store.promoted_step() == 3
    missing = runner.invoke(app, ["promote", "p", "agent", "9", "--root", str(tmp_path)])
    assert missing.exit_code != 0 and "no checkpoint of step 9" in str(missing.exception)
    rows = store.read_promotions()
    assert [(r["action"], r["step"], r["from_step"]) for r in rows[3:]] == [
        ("rollback", 2, 3),
        ("promote", 3, 2),
    ]
    assert all("@" in r["by"] for r in rows[3:])  # user@host
    listed = runner.invoke(app, ["checkpoints", "list", "p", "agent", "--root", str(tmp_path)])
    assert listed.exit_code == 0
    lines = listed.output.splitlines()
    assert any(line.split("│")[1].strip() == "3" and "promoted" in line for line in lines if "│" in line)
    log = listed.output.split("gate: candidate")[1]
    assert "rollback" in log and " train " not in log  # each training step's own move is left out
