"""An LLM used as a judge: any OpenAI-compatible endpoint, or a LangChain chat model.

::

    from journeyman.judge import Judge

    judge = Judge(model="o4-mini", base_url="https://api.openai.com/v1", api_key=key)
    judge = Judge(model="base", base_url=f"{gateway}/v1")          # the local base model
    judge = Judge(chat_model=ChatOpenAI(model="o4-mini"))          # any LangChain chat model

A :class:`Judge` sends one chat request and returns the reply's text. It bounds the time of each
call and the number of calls in flight, and says which errors are worth a retry; what counts as a
valid answer, and how often to ask again, is the caller's business (see :mod:`journeyman.judge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from journeyman.errors import ConfigError, JudgeCallError, JudgeError
from journeyman.store import default_root

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["Judge", "JudgeCallError"]

logger = logging.getLogger(__name__)

_RETRIED_STATUS = {408, 409, 429}


class Judge:
    """An LLM that judges; give ``base_url`` + ``model`` (OpenAI-compatible) or ``chat_model``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        chat_model: Any = None,
        timeout: float = 120.0,
        max_retries: int = 2,
        retry_delay: float = 1.0,
        max_concurrency: int = 4,
        temperature: float | None = None,
        max_tokens: int | None = None,
        structured_output: Literal["auto", "json_schema", "off"] = "auto",
        explanation_max_chars: int | None = 400,
        cache: bool = True,
        cache_dir: str | Path | None = None,
    ) -> None:
        """
        Args:
            model: the model name to request from ``base_url``.
            base_url: an OpenAI-compatible API (``.../v1``).
            api_key: its key (a local server needs none).
            chat_model: instead of an endpoint, a LangChain chat model (anything with ``ainvoke``).
            timeout: seconds one call may take before it counts as failed.
            max_retries: further attempts after a failed call or an invalid answer.
            retry_delay: seconds before the first retry; doubled before each next one.
            max_concurrency: judge calls in flight at once, across every group.
            temperature: sampling temperature (None: the endpoint's default; reasoning models
                accept no other). At 0, a retry after an invalid answer repeats that answer.
            max_tokens: longest answer (None: as long as the schema allows when it bounds the
                explanations, so a judge padding its JSON with whitespace stops early; else the
                endpoint's default).
            structured_output: ``json_schema`` constrains the answer with a JSON schema; ``auto``
                does so until the endpoint rejects it, then parses free text; ``off`` never does.
            explanation_max_chars: longest explanation the schema allows (keeps small local
                judges from rambling into ``max_tokens``); None for endpoints that reject ``maxLength``.
            cache: keep valid judgements on disk, so that the same question costs no second call.
            cache_dir: where (default ``$JOURNEYMAN_ROOT/judge_cache``).
        """
        if chat_model is None and (base_url is None or model is None):
            raise ConfigError(
                "a Judge needs an endpoint: give base_url and model (any OpenAI-compatible API, "
                "e.g. the local gateway's /v1 and the base model's name), or chat_model=<a LangChain chat model>"
            )
        if chat_model is not None and not hasattr(chat_model, "ainvoke"):
            raise ConfigError(
                f"chat_model must be a LangChain chat model (with an ainvoke method); got {type(chat_model).__name__}"
            )
        if timeout <= 0 or max_retries < 0 or retry_delay < 0 or max_concurrency < 1:
            raise ConfigError(
                "Judge needs timeout > 0, max_retries >= 0, retry_delay >= 0 and max_concurrency >= 1; got "
                f"{timeout=}, {max_retries=}, {retry_delay=}, {max_concurrency=}"
            )
        self.model = model
        self.base_url = base_url
        self.api_key = api_key
        self.chat_model = chat_model
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.max_concurrency = max_concurrency
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.structured_output = structured_output
        self.explanation_max_chars = explanation_max_chars
        self.cache_dir: Path | None = None
        if cache:
            self.cache_dir = Path(cache_dir) if cache_dir is not None else default_root() / "judge_cache"
        self.calls = 0
        """Calls sent so far (cache hits send none)."""
        self.prompt_tokens = 0
        """Prompt tokens the endpoint reported for those calls (0 where it reports none)."""
        self.completion_tokens = 0
        self.gives_logprobs: bool | None = None if chat_model is None else False
        """Whether the judge returns the logprobs that verdicts read: None until a verdict asks."""
        self._schema_rejected = False
        self._client: AsyncOpenAI | None = None
        self._semaphore: asyncio.Semaphore | None = None

    @property
    def name(self) -> str:
        """The judge model's name, part of every cache key."""
        if self.chat_model is None:
            assert self.model is not None
            return self.model
        for attribute in ("model_name", "model", "model_id"):
            value = getattr(self.chat_model, attribute, None)
            if isinstance(value, str) and value:
                return value
        return type(self.chat_model).__name__

    @property
    def uses_schema(self) -> bool:
        """Whether the next call will ask for structured output."""
        return self.chat_model is None and self.structured_output != "off" and not self._schema_rejected

    async def complete(
        self,
        messages: list[dict[str, str]],
        schema: dict[str, Any] | None = None,
        *,
        max_tokens: int | None = None,
    ) -> str:
        """The text of the judge's reply to ``messages``, constrained by ``schema`` when it can be.

        ``max_tokens`` is the caller's bound on the answer; an explicit ``Judge(max_tokens=...)``
        takes precedence. When the endpoint rejects the schema, the free-text answer asked for
        instead is not bounded by it (a JSON object written freely needs more).

        Raises :class:`JudgeCallError` for failures worth a retry and :class:`JudgeError` for
        ones that are not (a wrong key, an unknown model).
        """
        async with self._slot():
            if self.chat_model is not None:
                return await self._complete_chat_model(messages)
            return await self._complete_openai(messages, schema if self.uses_schema else None, max_tokens)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of the ``max_concurrency`` calls in flight, counted in :attr:`calls`."""
        if self._semaphore is None:  # made on first use, in the event loop that uses it
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            self.calls += 1
            yield

    async def _complete_openai(
        self, messages: list[dict[str, str]], schema: dict[str, Any] | None, max_tokens: int | None
    ) -> str:
        import openai

        request: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        elif max_tokens is not None:
            request["max_tokens"] = max_tokens
        if schema is not None:
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "judgement", "schema": schema, "strict": True},
            }
        try:
            response = await self._send(
                request, bad_request_ok=schema is not None and self.structured_output == "auto"
            )
        except openai.BadRequestError as error:
            text = await self._complete_openai(
                messages, None, None
            )  # if this fails too, the schema was not why
            logger.warning(
                "judge %r rejected structured output (%s); parsing free text from now on", self.name, error
            )
            self._schema_rejected = True
            return text
        return response.choices[0].message.content or ""

    async def verdict(
        self, messages: list[dict[str, str]], answers: tuple[str, ...] = ("yes", "no")
    ) -> dict[str, float]:
        """The probability of each of ``answers`` as the first token of the judge's reply.

        One prompt pass and one sampled token: read from the 20 likeliest first tokens, case and
        spaces ignored (``Yes``, `` yes`` and ``yes`` all count as ``yes``). An answer not among
        them gets 0. Needs an OpenAI-compatible endpoint that returns ``top_logprobs`` (vLLM does).
        """
        if self.chat_model is not None:
            raise ConfigError(
                "verdict scoring reads the logprobs of the reply's first token, which a LangChain chat model "
                "does not return: give the Judge base_url and model (an OpenAI-compatible endpoint)"
            )
        request = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                   "logprobs": True, "top_logprobs": 20}  # fmt: skip
        async with self._slot():
            response = await self._send(request)
        logprobs = response.choices[0].logprobs
        if logprobs is None or not logprobs.content:
            self.gives_logprobs = False
            raise JudgeError(
                f"judge {self.name!r} returned no logprobs: verdict scoring needs an endpoint that returns "
                "top_logprobs for chat completions (vLLM does), or method='scores'"
            )
        self.gives_logprobs = True
        mass = dict.fromkeys(answers, 0.0)
        for entry in logprobs.content[0].top_logprobs:
            word = entry.token.strip().lower()
            if word in mass:
                mass[word] += math.exp(entry.logprob)
        return mass

    async def _send(self, request: dict[str, Any], *, bad_request_ok: bool = False) -> Any:
        """One chat completion, its errors sorted into retried and not; counts its tokens."""
        import openai

        try:
            response = await self.client.chat.completions.create(**request)
        except openai.BadRequestError as error:
            if bad_request_ok:
                raise
            raise JudgeError(
                f"judge {self.name!r} refused the request: {error}. Check the Judge's model, temperature, "
                "max_tokens and structured_output settings against what the endpoint accepts."
            ) from error
        except openai.APIStatusError as error:
            if error.status_code >= 500 or error.status_code in _RETRIED_STATUS:
                raise JudgeCallError(
                    f"judge {self.name!r} answered HTTP {error.status_code}: {error}"
                ) from error
            raise JudgeError(
                f"judge {self.name!r} at {self.base_url} answered HTTP {error.status_code}: {error}. "
                "Check the judge's base_url, model name and api_key."
            ) from error
        except openai.APITimeoutError as error:
            raise JudgeCallError(f"judge {self.name!r} did not answer within {self.timeout} s") from error
        except openai.APIConnectionError as error:
            raise JudgeCallError(
                f"could not reach judge {self.name!r} at {self.base_url}: {error}"
            ) from error
        if response.usage is not None:
            self.prompt_tokens += response.usage.prompt_tokens
            self.completion_tokens += response.usage.completion_tokens
        if not response.choices:
            raise JudgeCallError(f"judge {self.name!r} returned no choices")
        return response

    async def _complete_chat_model(self, messages: list[dict[str, str]]) -> str:
        try:
            reply = await asyncio.wait_for(self.chat_model.ainvoke(messages), self.timeout)
        except TimeoutError as error:
            raise JudgeCallError(f"judge {self.name!r} did not answer within {self.timeout} s") from error
        except Exception as error:  # a chat model's own errors have no common type to sort by
            raise JudgeCallError(f"judge {self.name!r} failed: {type(error).__name__}: {error}") from error
        usage = getattr(reply, "usage_metadata", None) or {}  # LangChain's AIMessage
        self.prompt_tokens += int(usage.get("input_tokens", 0))
        self.completion_tokens += int(usage.get("output_tokens", 0))
        content = getattr(reply, "content", reply)
        if isinstance(content, list):  # content parts
            return "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in content)
        return str(content)

    @property
    def client(self) -> AsyncOpenAI:
        """The OpenAI client for ``base_url`` (made once; retries are the caller's, so none here)."""
        if self._client is None:
            import httpx
            from openai import AsyncOpenAI

            # An explicit httpx client, closed by aclose(): see Model.openai_client (openai-python #2440).
            self._client = AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key or "unused",
                timeout=self.timeout,
                max_retries=0,
                http_client=httpx.AsyncClient(timeout=self.timeout),
            )
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP client (a LangChain chat model is the caller's to close)."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        where = f"base_url={self.base_url!r}" if self.chat_model is None else "chat_model"
        return f"Judge({self.name!r}, {where})"
