"""Hub names as base models: found in the cache offline, downloaded once by this process online, and
a name the hub does not have is a clear error before any server starts. Nothing is downloaded here:
the hub is a small working stand-in over a dict of repositories."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects

import journeyman as jm
from journeyman.backend import LocalBackend, models
from journeyman.backend.serving.vllm import VLLMConfig
from journeyman.errors import ModelPreparationError

QWEN = {
    "config.json": 700,
    "tokenizer.json": 7_000_000,
    "model-00001-of-00002.safetensors": 4_000_000_000,
    "model-00002-of-00002.safetensors": 3_000_000_000,
    "pytorch_model.bin": 7_000_000_000,
    "original/consolidated.00.pth": 7_000_000_000,
    "onnx/model.onnx": 1_000,
}


def _refusal(error: type[RepositoryNotFoundError], status: int, url: str) -> RepositoryNotFoundError:
    response = httpx2.Response(status, request=httpx2.Request("GET", url))
    return error(f"{status} Client Error for url {url}", response=response)


class Hub:
    """What ``fetch_hub_model`` asks of ``huggingface_hub.HfApi``, over ``repos`` (name -> file sizes);
    a download writes the files it was asked for under ``cache``."""

    def __init__(self, cache: Path, repos: dict[str, dict[str, int]], *, gated: tuple[str, ...] = ()) -> None:
        self.cache, self.repos, self.gated = cache, repos, gated
        self.downloads: list[tuple[str, str | None, list[str]]] = []

    def model_info(self, repo_id: str, *, files_metadata: bool = False) -> Any:
        if repo_id not in self.repos:
            raise _refusal(RepositoryNotFoundError, 401, f"https://huggingface.co/api/models/{repo_id}")
        siblings = [SimpleNamespace(rfilename=name, size=size) for name, size in self.repos[repo_id].items()]
        return SimpleNamespace(sha="0123abcd", siblings=siblings)

    def snapshot_download(
        self, repo_id: str, *, revision: str | None = None, ignore_patterns: list[str] | str | None = None
    ) -> str:
        if repo_id in self.gated:
            raise _refusal(GatedRepoError, 403, f"https://huggingface.co/{repo_id}/resolve/main/config.json")
        folder = self.cache / repo_id.replace("/", "--") / str(revision)
        wanted = list(filter_repo_objects(list(self.repos[repo_id]), ignore_patterns=ignore_patterns))
        for name in wanted:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("{}")
        self.downloads.append((repo_id, revision, sorted(wanted)))
        return str(folder)


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process may reach the hub (tests run offline; the stand-in hub needs no network)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.mark.usefixtures("online")
def test_a_hub_model_is_downloaded_once_here_without_the_files_nothing_reads(tmp_path: Path) -> None:
    hub = Hub(tmp_path, {"Qwen/Qwen2.5-7B-Instruct": QWEN})
    folder = models.fetch_hub_model("Qwen/Qwen2.5-7B-Instruct", api=hub)
    assert folder == tmp_path / "Qwen--Qwen2.5-7B-Instruct" / "0123abcd"
    assert (folder / "config.json").is_file()
    ((repo, revision, files),) = hub.downloads  # once, here
    assert (
        repo == "Qwen/Qwen2.5-7B-Instruct" and revision == "0123abcd"
    )  # the commit model_info described, for vLLM and the trainer alike
    assert files == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json"
    ]  # fmt: skip


@pytest.mark.usefixtures("online")
def test_a_repository_without_safetensors_keeps_its_bin_weights(tmp_path: Path) -> None:
    hub = Hub(tmp_path, {"old/model": {"config.json": 1, "pytorch_model.bin": 10}})
    models.fetch_hub_model("old/model", api=hub)
    assert hub.downloads[0][2] == ["config.json", "pytorch_model.bin"]


@pytest.mark.usefixtures("online")
def test_a_name_the_hub_does_not_have_says_what_to_do(tmp_path: Path) -> None:
    hub = Hub(tmp_path, {})
    with pytest.raises(ModelPreparationError) as caught:
        models.fetch_hub_model("Qwen/Qwen2.5-7B-Instrukt", api=hub)
    message = str(caught.value)
    assert "no such model on the hub (https://huggingface.co/Qwen/Qwen2.5-7B-Instrukt)" in message
    assert "HF_TOKEN" in message and "smollm2-135m" in message and "save_pretrained" in message
    assert not hub.downloads


@pytest.mark.usefixtures("online")
def test_a_gated_repository_says_to_ask_for_access_and_set_hf_token(tmp_path: Path) -> None:
    hub = Hub(
        tmp_path, {"meta-llama/Llama-3.1-8B-Instruct": QWEN}, gated=("meta-llama/Llama-3.1-8B-Instruct",)
    )
    with pytest.raises(
        ModelPreparationError, match=r"gated .* https://huggingface.co/meta-llama/.* HF_TOKEN"
    ):
        models.fetch_hub_model("meta-llama/Llama-3.1-8B-Instruct", api=hub)


@pytest.mark.usefixtures("online")
def test_an_unreachable_hub_without_a_cached_copy_is_a_clear_error(tmp_path: Path) -> None:
    class Unreachable(Hub):
        def model_info(self, repo_id: str, *, files_metadata: bool = False) -> Any:
            raise httpx2.ConnectError("[Errno 101] Network is unreachable")

    with pytest.raises(
        ModelPreparationError, match=r"could not fetch .*ConnectError.* not in the Hugging Face cache"
    ):
        models.fetch_hub_model("nobody/never-cached-model", api=Unreachable(tmp_path, {}))


@pytest.mark.usefixtures("online")
def test_a_name_that_is_neither_a_folder_nor_a_hub_name_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelPreparationError, match=r"not an existing folder, and not a hub name"):
        models.fetch_hub_model(str(tmp_path / "no" / "such" / "folder"))  # the real HfApi refuses the id


def test_offline_an_uncached_hub_name_fails_before_any_server_starts(tmp_path: Path) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # as the tests run
    started: list[VLLMConfig] = []

    def engine(config: VLLMConfig, *, log_path: Path) -> Any:
        started.append(config)
        raise AssertionError("no server may start for an unknown base model")

    async def register() -> None:
        async with LocalBackend(root=tmp_path, engine=engine, gateway_thread=False) as backend:
            model = jm.TrainableModel(
                name="agent", project="hub", base_model="nobody/uncached", root=tmp_path
            )
            await model.register(backend)

    with pytest.raises(ModelPreparationError, match=r"'nobody/uncached'.* while HF_HUB_OFFLINE=1"):
        asyncio.run(register())
    assert not started


def test_converting_an_embedded_model_leaves_the_process_environment_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Servers started later inherit this process's environment: a conversion used to set
    HF_HUB_OFFLINE=1 in it for good, which took the hub from a judge served by hub name."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    with pytest.raises(OSError, match=r"none\.gguf"):  # read from its own folder only, then missing
        models._convert(tmp_path / "none.gguf", None, tmp_path / "out")
    assert dict(os.environ) == before
