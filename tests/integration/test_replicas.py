"""Two CPU vLLM replicas behind one gateway: adapters on both, each rollout sticks to one."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from journeyman.backend.serving.gateway import Gateway, GatewayThread, RecordLog
from journeyman.backend.serving.replicas import Replicas
from journeyman.backend.serving.router import Router
from journeyman.backend.serving.vllm import VLLMConfig, VLLMServer
from tests.integration.conftest import MAX_LORA_RANK, SERVED_BASE, make_adapter


@pytest.fixture
def replicas(model_dir: Path, tmp_path: Path) -> Iterator[Replicas]:
    servers = [
        VLLMServer(
            VLLMConfig(
                model=model_dir,
                served_name=SERVED_BASE,
                max_lora_rank=MAX_LORA_RANK,
                kv_cache_gib=1,
                cpu_cores=str(core),  # one core each
                reserved_cpus=0,
            ),
            log_path=tmp_path / f"vllm{core}.log",
        )
        for core in (0, 1)
    ]
    group = Replicas(servers).start(timeout=600)
    yield group
    group.stop()


def _requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


async def test_rollouts_stick_to_one_replica_and_adapters_load_on_both(
    replicas: Replicas, model_dir: Path, tmp_path: Path
) -> None:
    router = Router(replicas)
    records = RecordLog(tmp_path / "records.jsonl")
    adapter = make_adapter(model_dir, tmp_path / "adapter")
    for core, server in enumerate(replicas.servers):  # each on its core, its engine process too
        assert server.pid is not None
        engines = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        assert engines and all(os.sched_getaffinity(int(pid)) == {core} for pid in [server.pid, *engines])
    with GatewayThread(Gateway(router, records)) as gateway:
        await router.deploy("agent", adapter, 1)
        for server in replicas.servers:
            names = {m["id"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
            assert "agent@1" in names, server.base_url

        before = {s.base_url: _requests(s.base_url) for s in replicas.servers}
        rollouts = [f"rollout-{i}" for i in range(6)]
        expected: Counter[str] = Counter()
        async with httpx.AsyncClient(timeout=300) as client:
            for rollout in rollouts:
                messages = [{"role": "user", "content": f"Count to three, {rollout}."}]
                for _ in range(2):  # two turns: the second extends the first's prefix
                    response = await client.post(
                        f"{gateway.base_url}/r/{rollout}/v1/chat/completions",
                        json={"model": "agent", "messages": messages, "max_tokens": 6, "temperature": 0},
                    )
                    assert response.status_code == 200, response.text
                    messages += [
                        response.json()["choices"][0]["message"],
                        {"role": "user", "content": "Go on."},
                    ]
                    expected[replicas.url_for(rollout)] += 1
        served = {s.base_url: _requests(s.base_url) - before[s.base_url] for s in replicas.servers}
        assert served == {
            url: float(expected[url]) for url in served
        }  # every turn went where its rollout maps
        assert all(expected[s.base_url] for s in replicas.servers)  # and both replicas were used
        assert {r.rollout_id for r in records.for_rollout("rollout-0")} == {"rollout-0"}
    records.close()


async def test_local_backend_trains_behind_two_replicas(tmp_path: Path, tokenizer: Any) -> None:
    import journeyman as jm
    from journeyman.backend.local import LocalBackend, _share
    from tests.integration.test_distributed_trainer import groups

    async with LocalBackend(root=tmp_path, replicas=2) as backend:
        model = jm.TrainableModel(name="pair", project="test", base_model="smollm2-135m", root=tmp_path)
        await model.register(backend)
        assert isinstance(backend.server, Replicas)
        cores = [s.config.cpu_cores for s in backend.server.servers]
        assert cores == [_share(backend.vllm_cores, i, 2) for i in range(2)] and cores[0] != cores[1]
        result = await model.train(groups(tokenizer), jm.TrainConfig(learning_rate=5e-3))
        assert result.step == 1
        for server in backend.server.servers:
            names = {m["id"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
            assert "pair@1" in names, server.base_url
        response = await model.openai_client().chat.completions.create(
            model="pair", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        record = backend.records.get(response.id)  # type: ignore[union-attr]
        assert record is not None and record.served_model == "pair@1"
    assert {p.name for p in (tmp_path / "logs").iterdir()} >= {"vllm0.log", "vllm1.log"}
