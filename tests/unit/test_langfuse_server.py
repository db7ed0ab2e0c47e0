"""The real Langfuse SDK against the loopback Langfuse-API-compatible server: what goes over the
wire, what the read API gives back, and the round trip from a group to traces and back."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from langfuse import Langfuse
from langfuse.api.core.api_error import ApiError

import journeyman as jm
from journeyman.errors import InvalidDataError
from journeyman.integrations.langfuse import export_group, import_trajectories, trace_id
from journeyman.model import Registration, TrainResult
from tests.langfuse_server import LangfuseServer, client_for
from tests.strategies import groups
from tests.unit.test_langfuse import sample_trajectory


@pytest.fixture
def server() -> Iterator[LangfuseServer]:
    with LangfuseServer(public_key=f"pk-{uuid.uuid4().hex}") as server:
        yield server
        assert server.errors == []  # every answer parsed with the SDK's own models


@pytest.fixture
def client(server: LangfuseServer) -> Iterator[Langfuse]:
    client = client_for(server)
    yield client
    client.shutdown()


def sample_group() -> jm.TrajectoryGroup:
    first, second = sample_trajectory(1.0), sample_trajectory(0.0)
    second.metadata = {"scenario": "add-2-3"}  # no judge explanation: no comment
    return jm.TrajectoryGroup([first, second])


def test_an_exported_group_imports_back_equal(server: LangfuseServer, client: Langfuse) -> None:
    group = sample_group()
    since = datetime.now(UTC) - timedelta(seconds=1)
    ids = export_group(group, client, project="demo", model="calc-agent", step=3, split="train")
    assert ids == [trace_id(t.id) for t in group] and group.failures == []

    by_id = import_trajectories(client, trace_ids=ids)
    assert by_id == group.trajectories  # messages, model turns with token ids, tools, branches, rewards
    by_session = import_trajectories(client, session_id="demo/calc-agent")
    by_tags = import_trajectories(client, tags=["step:3", f"group:{group.id}"])
    by_window = import_trajectories(client, from_time=since, to_time=datetime.now(UTC) + timedelta(seconds=1))
    for found in (by_session, by_tags, by_window):
        assert sorted(found, key=lambda t: t.id) == sorted(group.trajectories, key=lambda t: t.id)
    assert import_trajectories(client, tags=["step:4"]) == []
    assert import_trajectories(client, from_time=datetime.now(UTC) + timedelta(minutes=1)) == []


def test_what_goes_over_the_wire(server: LangfuseServer, client: Langfuse) -> None:
    group = sample_group()
    export_group(group, client, project="demo", model="calc-agent")
    otlp = [r for r in server.requests if r.path == "/api/public/otel/v1/traces"]
    assert otlp, "spans go over OTLP/HTTP"
    for request in otlp:
        assert request.headers["content-type"] == "application/x-protobuf"
        assert request.headers["content-encoding"] == "gzip"
        assert request.headers["x-langfuse-ingestion-version"] == "4"
        assert request.headers["x-langfuse-public-key"] == server.public_key
    auth = base64.b64encode(f"{server.public_key}:{server.secret_key}".encode()).decode()
    assert all(
        r.headers["authorization"] == f"Basic {auth}"
        for r in server.requests
        if r.path != "/api/public/health"
    )

    # Langfuse's own view of the trace: types, tree, model, usage with the total it adds.
    observations = server.trace_observations(trace_id(group.trajectories[0].id))
    types = sorted(o["type"] for o in observations)
    assert types == ["AGENT", "AGENT", "GENERATION", "GENERATION", "GENERATION", "TOOL"]
    (root,) = [o for o in observations if o["isRootObservation"]]
    assert root["name"] == "calc" and root["sessionId"] == "demo/calc-agent"
    first = next(o for o in observations if o["type"] == "GENERATION" and o["usageDetails"].get("input") == 4)
    assert first["usageDetails"] == {"input": 4, "output": 2, "total": 6}
    assert first["model"] == "calc-agent@3" and first["parentObservationId"] == root["id"]
    assert set(server.traces[root["traceId"]]["tags"]) == {
        "model:calc-agent",
        f"group:{group.id}",
        "project:demo",
    }


def test_reward_metrics_and_judge_explanation_are_scores(server: LangfuseServer, client: Langfuse) -> None:
    group = sample_group()
    judged = group.trajectories[0]
    export_group(group, client)
    page = client.api.scores.get_many(trace_id=trace_id(judged.id), fields="details,subject")
    scores = {s.name: s for s in page.data}
    assert set(scores) == {"reward", "tool_calls", "solved", "seconds"}
    assert scores["reward"].value == 1.0 and scores["reward"].comment == judged.metadata["judge_explanation"]
    assert scores["solved"].data_type == "BOOLEAN" and scores["solved"].value is True
    assert scores["seconds"].data_type == "NUMERIC" and scores["seconds"].value == 1.5
    assert all(s.subject is not None and s.subject.kind == "trace" for s in page.data)

    # Exporting again (say, after re-judging) updates the scores instead of adding more, and the
    # import reads the latest export of the trace.
    judged.reward = 0.5
    judged.logs.append("re-judged")
    export_group(group, client)
    assert len(server.scores) == 8
    assert import_trajectories(client, trace_ids=[trace_id(judged.id)]) == [judged]
    (reward,) = client.api.scores.get_many(trace_id=trace_id(judged.id), name="reward").data
    assert reward.value == 0.5
    assert import_trajectories(client, trace_ids=[trace_id(judged.id)])[0].reward == 0.5


def test_the_double_pages_selects_fields_and_filters_as_langfuse_documents(
    server: LangfuseServer, client: Langfuse
) -> None:
    """The test server's read API: pages, field groups, expanded metadata, filters and its 400s.

    Of the double, not of journeyman: nothing has checked these answers against a real Langfuse, so
    this is no evidence of compatibility (tests/integration/test_langfuse_live.py is, where it runs)."""
    group = sample_group()
    export_group(group, client, project="demo", model="calc-agent")
    pages, cursor = [], None
    while True:
        page = client.api.observations.get_many(limit=5, cursor=cursor)
        pages.append(page.data)
        cursor = page.meta.cursor
        if cursor is None:
            break
    assert [len(p) for p in pages] == [5, 5, 2]
    assert len({o.id for p in pages for o in p}) == 12
    default = pages[0][0]  # the default groups are core and basic
    assert default.name is not None and default.input is None and default.type
    core = client.api.observations.get_many(limit=1, fields="core").data[0]
    assert core.name is None and core.trace_id == default.trace_id

    root = client.api.observations.get_many(is_root_observation=True, fields="metadata", limit=1).data[0]
    assert (
        root.metadata is not None and len(root.metadata["journeyman"]) == 200
    )  # metadata cut to 200 characters
    expanded = client.api.observations.get_many(
        trace_id=root.trace_id, is_root_observation=True, fields="metadata", expand_metadata="journeyman"
    ).data[0]
    assert (
        expanded.metadata is not None
        and json.loads(json.loads(expanded.metadata["journeyman"]))["schema"] == 1
    )

    # The structured filter wins over the single query parameters, as documented.
    tools = json.dumps([{"type": "string", "column": "type", "operator": "=", "value": "TOOL"}])
    found = client.api.observations.get_many(type="GENERATION", filter=tools, fields="basic").data
    assert [o.type for o in found] == ["TOOL", "TOOL"]

    for bad_call in (
        lambda: client.api.observations.get_many(parse_io_as_json=True),
        lambda: client.api.observations.get_many(limit=1001),
        lambda: client.api.observations.get_many(filter="[{"),
        lambda: client.api.scores.get_many(limit=101),
        lambda: client.api.scores.get_many(fields="everything"),
        lambda: client.api.scores.get_many(observation_id="x"),
        lambda: client.api.scores.get_many(trace_id="a", session_id="b"),
    ):
        with pytest.raises(ApiError) as error:
            bad_call()
        assert error.value.status_code == 400


def test_wrong_keys_are_a_recorded_failure_not_a_crash(server: LangfuseServer) -> None:
    wrong = Langfuse(public_key=server.public_key, secret_key="sk-wrong", base_url=server.base_url)
    try:
        group = sample_group()
        assert export_group(group, wrong) == []
        (failure,) = group.failures
        assert (
            failure.stage == "export"
            and "cannot reach Langfuse" in failure.message
            and "401" in failure.message
        )
        assert server.observations == {}
    finally:
        wrong.shutdown()


def test_rejected_scores_do_not_stop_the_others(server: LangfuseServer, client: Langfuse) -> None:
    server.reject_scores = {"solved"}
    group = sample_group()
    export_group(group, client)
    assert sorted(s["name"] for s in server.scores.values()) == sorted(
        ["reward", "seconds", "tool_calls"] * 2
    )
    assert len(server.observations) == 12


def test_import_says_what_is_wrong(client: Langfuse) -> None:
    with pytest.raises(InvalidDataError, match="has no observations"):
        import_trajectories(client, trace_ids=["0" * 32])
    with pytest.raises(InvalidDataError, match="needs trace_ids or a filter"):
        import_trajectories(client)


async def rollout(reward: float) -> jm.Trajectory:
    trajectory = sample_trajectory(reward)
    trajectory.metadata = {"scenario": "add-2-3"}
    return trajectory


async def test_gather_exports_each_group_as_it_finishes(server: LangfuseServer, client: Langfuse) -> None:
    groups = await jm.gather_trajectory_groups(
        [jm.TrajectoryGroup(rollout(r) for r in (1.0, 0.0)) for _ in range(2)],
        progress=False,
        langfuse=client,
    )
    for group in groups:
        assert group.failures == []
        found = import_trajectories(client, tags=[f"group:{group.id}"])
        assert sorted(found, key=lambda t: t.id) == sorted(group.trajectories, key=lambda t: t.id)


async def test_gather_goes_on_when_langfuse_is_down() -> None:
    down = Langfuse(public_key=f"pk-{uuid.uuid4().hex}", secret_key="sk", base_url="http://127.0.0.1:9")
    try:
        (group,) = await jm.gather_trajectory_groups(
            [jm.TrajectoryGroup(rollout(r) for r in (1.0, 0.0))], progress=False, langfuse=down
        )
        assert len(group) == 2 and [f.stage for f in group.failures] == ["export"]
    finally:
        down.shutdown()


class StepBackend:
    """A backend that trains nothing: enough to check what train() exports first."""

    def __init__(self) -> None:
        self.trained: list[list[jm.TrajectoryGroup]] = []

    async def register(self, model: jm.TrainableModel) -> Registration:
        return Registration(base_url="http://127.0.0.1:1/v1", api_key="-", step=4)

    async def get_step(self, model: jm.TrainableModel) -> int:
        return 4

    async def train(
        self, model: jm.TrainableModel, groups: Sequence[jm.TrajectoryGroup], config: Any
    ) -> TrainResult:
        self.trained.append(list(groups))
        return TrainResult(step=5)

    async def list_checkpoints(self, model: jm.TrainableModel) -> list[int]:
        return [4]

    async def delete_checkpoints(
        self, model: jm.TrainableModel, best_metric: str | None, *, higher_is_better: bool = True
    ) -> list[int]:
        return []


async def test_train_exports_its_groups_with_step_split_and_run(
    server: LangfuseServer, client: Langfuse, tmp_path: Any
) -> None:
    backend = StepBackend()
    model = jm.TrainableModel(name="calc-agent", project="demo", base_model="smollm2-135m", root=tmp_path)
    await model.register(backend)
    group = sample_group()
    result = await model.train([group], langfuse=client)
    assert result.step == 5 and backend.trained == [[group]]
    found = import_trajectories(client, session_id="demo/calc-agent", tags=["step:4", "split:train"])
    assert sorted(found, key=lambda t: t.id) == sorted(group.trajectories, key=lambda t: t.id)


async def test_log_exports_evaluation_groups_with_their_split_and_step(
    server: LangfuseServer, client: Langfuse, tmp_path: Any
) -> None:
    model = jm.TrainableModel(name="calc-agent", project="demo", base_model="smollm2-135m", root=tmp_path)
    await model.register(StepBackend())
    group = sample_group()
    await model.log([group], split="val", langfuse=client)
    found = import_trajectories(client, session_id="demo/calc-agent", tags=["step:4", "split:val"])
    assert sorted(t.id for t in found) == sorted(t.id for t in group.trajectories)
    assert model.store.load_groups("val", 4)[0].trajectories == group.trajectories  # stored as well


def test_langfuse_true_means_the_project_in_the_environment_even_with_other_clients_about(
    server: LangfuseServer, client: Langfuse, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``langfuse.get_client()`` alone returns a disabled client once two projects' clients exist
    in a process (and with one, that one): ``langfuse=True`` must follow $LANGFUSE_PUBLIC_KEY."""
    with LangfuseServer(public_key=f"pk-{uuid.uuid4().hex}") as other:
        other_client = client_for(other)
        try:
            for key, value in {"LANGFUSE_PUBLIC_KEY": server.public_key, "LANGFUSE_SECRET_KEY": server.secret_key,
                               "LANGFUSE_BASE_URL": server.base_url}.items():  # fmt: skip
                monkeypatch.setenv(key, value)
            group = sample_group()
            assert len(jm.plugins.exporter("langfuse", True).export_group(group)) == len(group)
            assert group.failures == [] and other.traces == {}
            found = import_trajectories(client, trace_ids=[trace_id(t.id) for t in group])
            assert sorted(t.id for t in found) == sorted(t.id for t in group.trajectories)
        finally:
            other_client.shutdown()


def test_the_double_maps_spans_from_other_instrumentation(server: LangfuseServer) -> None:
    """The test server's OTLP JSON ingestion: a non-Langfuse tracer's spans get their type from the
    GenAI attributes.

    Of the double, not of journeyman: nothing has checked these answers against a real Langfuse, so
    this is no evidence of compatibility (tests/integration/test_langfuse_live.py is, where it runs)."""

    def span(span_id: str, name: str, attributes: dict[str, Any], parent: str = "") -> dict[str, Any]:
        return {
            "traceId": "5b8efff798038103d269b633813fc60c",
            "spanId": span_id,
            "parentSpanId": parent,
            "name": name,
            "startTimeUnixNano": "1767225600123456789",
            "endTimeUnixNano": "1767225601000000000",
            "attributes": [
                {"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": v}}
                for k, v in attributes.items()
            ],
        }

    spans = [
        span("eee19b7ec3c1b174", "agent run", {"session.id": "s-1"}),
        span(
            "eee19b7ec3c1b175",
            "chat qwen",
            {"gen_ai.operation.name": "chat", "gen_ai.request.model": "qwen", "gen_ai.usage.input_tokens": 7},
            parent="eee19b7ec3c1b174",
        ),
        span("eee19b7ec3c1b176", "run tool", {"gen_ai.tool.name": "search"}, parent="eee19b7ec3c1b174"),
    ]
    body = {"resourceSpans": [{"scopeSpans": [{"scope": {"name": "my-tracer"}, "spans": spans}]}]}
    auth = base64.b64encode(f"{server.public_key}:{server.secret_key}".encode()).decode()
    response = httpx.post(
        f"{server.base_url}/api/public/otel/v1/traces",
        json=body,
        headers={"authorization": f"Basic {auth}"},
    )
    assert response.status_code == 200
    observations = {o["name"]: o for o in server.trace_observations("5b8efff798038103d269b633813fc60c")}
    assert observations["agent run"]["type"] == "SPAN" and observations["agent run"]["isRootObservation"]
    chat = observations["chat qwen"]
    assert (chat["type"], chat["model"], chat["usageDetails"]) == (
        "GENERATION",
        "qwen",
        {"input": 7, "total": 7},
    )
    assert chat["startTime"] == "2026-01-01T00:00:00.123Z"  # milliseconds, as Langfuse keeps them
    assert observations["search"]["type"] == "TOOL"  # named after gen_ai.tool.name
    assert all(o["sessionId"] == "s-1" for o in observations.values() if o["name"] == "agent run")
    wrong = httpx.post(f"{server.base_url}/api/public/otel/v1/traces", json=body)
    assert wrong.status_code == 401


def test_any_group_round_trips(server: LangfuseServer, client: Langfuse) -> None:
    """Property: whatever a group holds, export then import gives its trajectories back."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(groups())
    def round_trip(group: jm.TrajectoryGroup) -> None:
        ids = export_group(group, client, check_connection=False)
        assert import_trajectories(client, trace_ids=ids) == group.trajectories
        assert group.failures == [] or all(f.stage == "rollout" for f in group.failures)

    round_trip()


def test_edge_cases_found_by_the_property_test(server: LangfuseServer, client: Langfuse) -> None:
    # The SDK's serializer turns integers beyond 2**53 into strings; a metric named like the
    # reward score must not overwrite it; a trajectory without model turns is all "tail".
    trajectory = jm.Trajectory(
        conversation=[{"role": "user", "content": "hi"}],
        metadata={"big": 2**60},
        metrics={"reward": 2},
        reward=0.5,
    )
    (tid,) = export_group(jm.TrajectoryGroup([trajectory]), client)
    assert import_trajectories(client, trace_ids=[tid]) == [trajectory]
    (reward,) = client.api.scores.get_many(trace_id=tid, name="reward").data
    assert reward.value == 0.5


def test_the_doubles_environment_filter_takes_one_or_many(server: LangfuseServer, client: Langfuse) -> None:
    """The test server's environment filter: one name or a list.

    Of the double, not of journeyman: nothing has checked these answers against a real Langfuse, so
    this is no evidence of compatibility (tests/integration/test_langfuse_live.py is, where it runs)."""
    export_group(sample_group(), client)
    assert len(client.api.observations.get_many(environment="default").data) == 12
    assert len(client.api.observations.get_many(environment=["staging", "default"]).data) == 12
    assert client.api.observations.get_many(environment="production").data == []
