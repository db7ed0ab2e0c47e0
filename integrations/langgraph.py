"""Capture LangGraph and LangChain runs as trajectories with one callback.

::

    from journeyman.integrations.langgraph import TrajectoryTracer

    tracer = TrajectoryTracer()
    result = graph.invoke(inputs, config={"callbacks": [tracer]})   # the one line
    trajectory = tracer.trajectory                                   # finished when the run ended

Every chat-model call (the messages as sent, the bound tools, the reply and its tool calls),
tool call and error is captured. When the run ends, each call is joined to the gateway's record
by its completion id (``response_metadata["id"]``), so its model turn carries the exact prompt
and completion token ids and logprobs. Conversations that diverge from the main one (a
sub-graph or sub-agent with its own messages) become ``trajectory.additional_histories``.
Token-streamed calls (``streaming=True``, ``stream_mode="messages"``) are joined too: langchain-openai
drops the chunks' ``id``, but the gateway also puts it in each delta, which langchain-openai
makes the message id. Streamed from an endpoint without the gateway, they keep their messages
only, flagged in ``metrics["calls_without_tokens"]``.

The one change to the agent: its chat model calls the model being trained. :func:`chat_model` makes
that ``ChatOpenAI`` for one rollout (the gateway's URL, the model's name, and the rollout's id on
each call, so the gateway records the calls under it and a canary's share of rollouts goes to the
candidate); a ``ChatOpenAI`` of your own pointed at ``model.inference_base_url`` with
``model=model.inference_name`` works too, without the rollout id.

One tracer can watch many runs at once (``invoke``/``ainvoke``/``stream``/``astream``, threads
or tasks); each root run gives one trajectory (:attr:`TrajectoryTracer.trajectories`,
:meth:`TrajectoryTracer.trajectory_for`). Tracing never raises into the agent: its own errors
are logged and counted in :attr:`TrajectoryTracer.errors` (``raise_error=True`` raises them).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, cast
from uuid import UUID

from journeyman.errors import ConfigError, MissingDependencyError
from journeyman.model import Model
from journeyman.records import ROLLOUT_HEADER
from journeyman.trajectory import Trajectory

from .capture import Call, RecordSource, ToolRun, Tracer, TracerOptions, rollout_call

try:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import BaseMessage, convert_to_openai_messages
    from langchain_core.outputs import ChatGeneration, LLMResult
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise MissingDependencyError(
        "langchain-core", "langgraph", "journeyman.integrations.langgraph"
    ) from error

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

__all__ = ["TrajectoryTracer", "chat_model"]

F = TypeVar("F", bound=Callable[..., None])

_CHAT_MODELS: dict[tuple[int, str], tuple[Model, Any]] = {}
"""One ``ChatOpenAI`` per model and options, copied for each rollout: the copies share its HTTP
clients (an ``AsyncOpenAI`` dropped without closing can hang other requests: openai-python#2440)."""


def chat_model(model: Model, *, rollout_id: str | None = None, **options: Any) -> ChatOpenAI:
    """A ``langchain_openai.ChatOpenAI`` that calls ``model`` through journeyman's gateway, for one
    rollout: build the agent with it in the rollout function.

    Each call carries ``rollout_id`` (the ``X-Journeyman-Rollout-Id`` header): the gateway records
    the call under it, and while a canary runs (:meth:`~journeyman.TrainableModel.canary`) the
    rollout's calls all go to the candidate or all to the promoted step, so the gate can compare
    them (:func:`~journeyman.gate.promote_canary_if_better`). Default: an id made from the
    :func:`~journeyman.rollout_info` of the training loop's rollout in progress (which also gives
    the call its sampling ``seed``), else a new one. ``options`` go to ``ChatOpenAI``
    (``temperature``, ``max_tokens``, ``timeout``...)."""
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as error:  # pragma: no cover - depends on the installed extras
        raise MissingDependencyError("langchain-openai", "langgraph", "chat_model") from error
    rollout_id, info = rollout_call(model, rollout_id, "chat model")
    endpoint = (model.inference_base_url, model.inference_name, model.inference_api_key)
    key = (id(model), repr((endpoint, sorted(options.items()))))  # registered again: a new one
    made = _CHAT_MODELS.get(key)
    if made is None or made[0] is not model:
        made = _CHAT_MODELS[key] = (model, ChatOpenAI(
            model=model.inference_name, base_url=model.inference_base_url,
            api_key=model.inference_api_key or "journeyman", **options,
        ))  # fmt: skip
    base: ChatOpenAI = made[1]
    update: dict[str, Any] = {
        "model_kwargs": {**base.model_kwargs, "extra_headers": {ROLLOUT_HEADER: rollout_id}}
    }
    if info is not None and "seed" not in options:
        update["seed"] = info.seed
    return base.model_copy(update=update)


def _guarded(method: F) -> F:
    """Run a callback so that a bug in tracing never reaches the agent (unless raise_error)."""

    @functools.wraps(method)
    def wrapper(self: TrajectoryTracer, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception as error:
            self.failed(method.__name__, error)

    return cast(F, wrapper)


class _RootEndOffTheLoop:
    """``on_chain_end``/``on_chain_error``, whose end of a root run joins its calls to the gateway's
    records (over HTTP from a gateway in another process). The tracer runs inline, so in an async
    run LangChain calls it on the event loop's own thread: there this is a coroutine function,
    which LangChain awaits, and a root run's end runs on a worker thread, leaving the loop free for
    the other rollouts; elsewhere (a sync run, any other run's end) it is the plain method."""

    def __init__(self, method: Callable[..., None]) -> None:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, tracer: TrajectoryTracer | None, owner: type | None = None) -> Any:
        if tracer is None:
            return self
        plain = functools.partial(self.method, tracer)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return plain

        async def off_the_loop(*args: Any, run_id: UUID, **kwargs: Any) -> None:
            if tracer.is_root(run_id):
                await asyncio.to_thread(plain, *args, run_id=run_id, **kwargs)
            else:
                plain(*args, run_id=run_id, **kwargs)

        return off_the_loop


def _streamed_id(message_id: str | None) -> str | None:
    """The completion id of a token-streamed reply: the gateway puts it in each delta, which
    langchain-openai makes the message id (LangChain's own ids start with ``lc_`` or ``run-``)."""
    if message_id is None or message_id.startswith(("lc_", "run-")):
        return None
    return message_id


@dataclass
class _Run:
    """What one root run captured so far."""

    trajectory: Trajectory
    runs: set[UUID] = field(default_factory=set)
    calls: dict[UUID, Call] = field(default_factory=dict)
    tools: dict[UUID, ToolRun] = field(default_factory=dict)


class TrajectoryTracer(Tracer, BaseCallbackHandler):
    """A LangChain callback handler that turns each root run into a :class:`~journeyman.Trajectory`.

    ``records`` is where completion records are read: the gateway's ``RecordLog`` (in process),
    a gateway URL, or None to ask the gateway each chat model points at (its ``base_url``).
    A gateway URL whose gateway runs in this process is read directly, without HTTP.
    ``api_key`` authenticates HTTP reads against ``journeyman serve``.
    """

    run_inline = True  # cheap handlers: run them in the caller's thread, in event order

    def __init__(self, records: RecordSource | str | None = None, **options: Unpack[TracerOptions]) -> None:
        super().__init__(records, **options)
        self.trajectories: list[Trajectory] = []
        """Finished trajectories, in the order their runs ended."""
        self._by_run: dict[UUID, Trajectory] = {}
        self._active: dict[UUID, _Run] = {}
        self._root_of: dict[UUID, UUID] = {}

    # Results ------------------------------------------------------------------------------------

    @property
    def trajectory(self) -> Trajectory:
        """The trajectory of the run that ended last."""
        with self._lock:
            if not self.trajectories:
                raise ConfigError(
                    "no traced run has finished yet: pass the tracer as "
                    "config={'callbacks': [tracer]} and read it after invoke/stream returns"
                )
            return self.trajectories[-1]

    def pop_trajectories(self) -> list[Trajectory]:
        """Hand over the finished trajectories and forget them (a long-lived tracer stays small)."""
        with self._lock:
            done, self.trajectories = self.trajectories, []
            self._by_run.clear()
            return done

    def trajectory_for(self, run_id: UUID | str) -> Trajectory:
        """The trajectory of one root run (set your own with ``config={"run_id": ...}``)."""
        key = UUID(str(run_id))
        with self._lock:
            if key not in self._by_run:
                raise KeyError(f"no finished run {key} (running: {key in self._active})")
            return self._by_run[key]

    # Run tree -----------------------------------------------------------------------------------

    def _start(self, run_id: UUID, parent_run_id: UUID | None, metadata: dict[str, Any] | None) -> _Run:
        root = self._root_of.get(parent_run_id) if parent_run_id is not None else None
        if root is None:
            root = run_id
            trajectory = Trajectory()
            trajectory.metadata["run_id"] = str(run_id)
            for key, value in (metadata or {}).items():
                if isinstance(value, str | int | float | bool) and not key.startswith("ls_"):
                    trajectory.metadata.setdefault(key, value)
            self._active[root] = _Run(trajectory)
        run = self._active[root]
        run.runs.add(run_id)
        self._root_of[run_id] = root
        return run

    def is_root(self, run_id: UUID) -> bool:
        """Whether ``run_id`` is a root run still being traced (its end finishes a trajectory)."""
        with self._lock:
            return run_id in self._active

    def _run(self, run_id: UUID) -> _Run | None:
        root = self._root_of.get(run_id)
        return self._active.get(root) if root is not None else None

    def _call(self, run_id: UUID) -> Call | None:
        with self._lock:
            run = self._run(run_id)
            return run.calls.get(run_id) if run is not None else None

    def _tool(self, run_id: UUID) -> ToolRun | None:
        with self._lock:
            run = self._run(run_id)
            return run.tools.get(run_id) if run is not None else None

    def _end(self, run_id: UUID, error: BaseException | None = None) -> None:
        """Finish the trajectory when ``run_id`` is a root run."""
        with self._lock:
            run = self._active.get(run_id)
            if run is None:
                return
            del self._active[run_id]
            for child in run.runs:
                self._root_of.pop(child, None)
        trajectory = self.finish(run.trajectory, run.calls.values(), run.tools.values(), error=error)
        with self._lock:
            self.trajectories.append(trajectory)
            self._by_run[run_id] = trajectory

    # Chains (graph, nodes) ----------------------------------------------------------------------

    @_guarded
    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self._lock:
            self._start(run_id, parent_run_id, metadata)

    @_RootEndOffTheLoop
    @_guarded
    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id)

    @_RootEndOffTheLoop
    @_guarded
    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._end(run_id, error)

    # Chat models --------------------------------------------------------------------------------

    @_guarded
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        invocation_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        sent = convert_to_openai_messages(messages[0]) if messages else []
        params = invocation_params or {}
        constructor = (serialized or {}).get("kwargs") or {}
        endpoint = constructor.get("openai_api_base") or constructor.get("base_url")
        call = Call(
            messages=list(sent) if isinstance(sent, list) else [sent],
            tools=params.get("tools"),
            name=(metadata or {}).get("langgraph_node") or kwargs.get("name"),
            endpoint=endpoint if isinstance(endpoint, str) else None,
        )
        with self._lock:
            self._start(run_id, parent_run_id, metadata).calls[run_id] = call

    @_guarded
    def on_llm_end(self, response: LLMResult, *, run_id: UUID, **kwargs: Any) -> None:
        call = self._call(run_id)
        if call is not None and response.generations and response.generations[0]:
            generation = response.generations[0][0]
            if isinstance(generation, ChatGeneration):
                message = generation.message
                reply = convert_to_openai_messages(message)
                call.reply = reply if isinstance(reply, dict) else None
                call.completion_id = (
                    message.response_metadata.get("id")
                    or (response.llm_output or {}).get("id")
                    or _streamed_id(message.id)
                )
            else:
                call.reply = {"role": "assistant", "content": generation.text}
        self._end(run_id)

    @_guarded
    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        call = self._call(run_id)
        if call is not None:
            call.error = f"{type(error).__name__}: {error}"
        self._end(run_id, error)

    # Tools --------------------------------------------------------------------------------------

    @_guarded
    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        metadata: dict[str, Any] | None = None,
        inputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        name = kwargs.get("name") or (serialized or {}).get("name") or "tool"
        tool = ToolRun(name=str(name), tool_call_id=kwargs.get("tool_call_id"), arguments=inputs or input_str)
        with self._lock:
            self._start(run_id, parent_run_id, metadata).tools[run_id] = tool

    @_guarded
    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        tool = self._tool(run_id)
        if tool is not None:
            content = getattr(output, "content", output)
            tool.output = content if isinstance(content, str) else str(content)
            if getattr(output, "status", None) == "error":
                tool.error = tool.output
        self._end(run_id)

    @_guarded
    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        tool = self._tool(run_id)
        if tool is not None:
            tool.error = f"{type(error).__name__}: {error}"
        self._end(run_id, error)
