"""CrewTracer on a real CrewAI crew, against the real gateway in front of a scripted model."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.router import Router
from tests.scripted_agent import ScriptedModel
from tests.scripted_upstream import ScriptedServer, serve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def crew_policy(body: dict[str, Any]) -> dict[str, Any]:
    """Call ``add`` once when tools are bound, then report the last tool result."""
    messages = body["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    if body.get("tools") and not results:
        arguments = json.dumps({"a": 2, "b": 3} if "2 plus 3" in json.dumps(messages) else {"a": 13, "b": 1})
        call = {"id": "", "type": "function", "function": {"name": "add", "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if results:
        return {"role": "assistant", "content": f"The sum is {results[-1]}."}
    return {"role": "assistant", "content": "Report: the sum is 5."}


@pytest.fixture
def crewai(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CrewAI offline, writing under a temporary HOME (it writes there even on import)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")
    monkeypatch.chdir(tmp_path)
    return importlib.import_module("crewai")


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[GatewayThread]:
    upstream = serve(ScriptedModel(crew_policy).app())
    gateway = GatewayThread(
        Gateway(
            Router(ScriptedServer(upstream.base_url, log_dir=tmp_path)), RecordLog(tmp_path / "records.jsonl")
        )
    ).start()
    yield gateway
    gateway.stop()
    upstream.stop()


def _crew(crewai: Any, gateway: GatewayThread, question: str = "What is 2 plus 3?") -> Any:
    from crewai.tools import tool

    @tool("add")
    def add(a: int, b: int) -> int:
        """Add two integers."""
        if a == 13:
            raise ValueError("13 is unlucky")
        return a + b

    llm = crewai.LLM(model="openai/m", base_url=f"{gateway.base_url}/v1", api_key="-", temperature=0)
    calculator = crewai.Agent(
        role="Calculator", goal="Compute sums", backstory="Careful.", llm=llm, tools=[add]
    )
    writer = crewai.Agent(role="Writer", goal="Report results", backstory="Brief.", llm=llm)
    tasks = [
        crewai.Task(description=question, expected_output="A number", agent=calculator),
        crewai.Task(description="Report the sum.", expected_output="A sentence", agent=writer),
    ]
    return crewai.Crew(agents=[calculator, writer], tasks=tasks)


def test_two_agent_crew_gives_one_history_per_agent(crewai: Any, scripted: GatewayThread) -> None:
    from journeyman.integrations.crewai import CrewTracer

    crew = _crew(crewai, scripted)
    with CrewTracer(raise_error=True) as tracer:
        output = crew.kickoff()
    assert str(output) == "Report: the sum is 5."
    trajectory = tracer.trajectory
    calculator, writer = trajectory.histories
    assert calculator.name == "Calculator" and writer.name == "Writer"
    assert [m.role for m in calculator.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert calculator.messages[3].content == "5" and calculator.messages[4].content == "The sum is 5."
    assert calculator.tools is not None and calculator.tools[0].function.name == "add"
    assert [m.role for m in writer.messages] == ["system", "user", "assistant"]
    assert "The sum is 5." in str(writer.messages[1].content)  # the first agent's output is its context
    for history in trajectory.histories:
        for index, item in enumerate(history.conversation):
            if hasattr(item, "completion_id"):
                record = scripted.gateway.records.get(item.completion_id or "")
                assert record is not None and item.is_token_exact  # type: ignore[union-attr]
                assert item.prompt_token_ids == record.prompt_token_ids  # type: ignore[union-attr]
                assert history.messages[:index] == type(history)(conversation=record.messages or []).messages
    assert trajectory.metrics["llm_calls"] == 3 and trajectory.metrics["token_exact_calls"] == 3
    assert trajectory.metrics["tool_calls"] == 1 and tracer.errors == 0


def test_tool_error_is_recorded_and_handlers_are_removed(crewai: Any, scripted: GatewayThread) -> None:
    from crewai.events import LLMCallStartedEvent, crewai_event_bus

    from journeyman.integrations.crewai import CrewTracer

    crew = _crew(crewai, scripted, "What is 13 plus 1?")
    before = len(crewai_event_bus._sync_handlers.get(LLMCallStartedEvent, ()))
    with CrewTracer(scripted.gateway.records, crew=crew, raise_error=True) as tracer:
        assert len(crewai_event_bus._sync_handlers.get(LLMCallStartedEvent, ())) == before + 1
        crew.kickoff()
    assert len(crewai_event_bus._sync_handlers.get(LLMCallStartedEvent, ())) == before
    trajectory = tracer.trajectory
    assert trajectory.metrics["tool_errors"] >= 1
    assert any("13 is unlucky" in line for line in trajectory.logs)
    tool_results = [m for m in trajectory.messages if m.role == "tool"]
    assert tool_results and "13 is unlucky" in str(tool_results[0].content)


def test_trajectory_before_exit_is_a_clear_error(crewai: Any) -> None:
    import journeyman as jm
    from journeyman.integrations.crewai import CrewTracer

    with pytest.raises(jm.ConfigError, match="block exits"):
        _ = CrewTracer().trajectory


def test_unreachable_model_fails_the_crew_as_before_and_is_recorded(crewai: Any) -> None:
    from journeyman.integrations.crewai import CrewTracer

    llm = crewai.LLM(
        model="openai/m", base_url="http://127.0.0.1:9/v1", api_key="-", max_retries=0, timeout=2
    )
    agent = crewai.Agent(role="Calculator", goal="Compute sums", backstory="Careful.", llm=llm, max_iter=1)
    crew = crewai.Crew(
        agents=[agent], tasks=[crewai.Task(description="Hi", expected_output="A word", agent=agent)]
    )
    with pytest.raises(Exception) as raised, CrewTracer(raise_error=True) as tracer:
        crew.kickoff()
    trajectory = tracer.trajectory
    assert trajectory.metrics["llm_errors"] >= 1 and trajectory.metrics["llm_calls"] == 0
    assert type(raised.value).__name__ in str(trajectory.metadata["error"])
    assert any("failed" in line for line in trajectory.logs)


def test_concurrent_crews_are_kept_apart_by_crew(crewai: Any, scripted: GatewayThread) -> None:
    from journeyman.integrations.crewai import CrewTracer

    crews = [_crew(crewai, scripted), _crew(crewai, scripted, "What is 2 plus 3 again?")]

    def run(crew: Any) -> Any:
        with CrewTracer(crew=crew, raise_error=True) as tracer:
            crew.kickoff()
        return tracer.trajectory

    with ThreadPoolExecutor(2) as pool:
        trajectories = list(pool.map(run, crews))
    for crew, trajectory in zip(crews, trajectories, strict=True):
        assert [h.name for h in trajectory.histories] == ["Calculator", "Writer"]
        assert crew.tasks[0].description in str(trajectory.messages[1].content)
        assert trajectory.metrics["llm_calls"] == 3 and trajectory.metrics["token_exact_calls"] == 3
