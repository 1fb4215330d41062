"""A GGUF model on llama.cpp (through ``llama-cpp-python``'s low-level API), used by both sides:
the verifier's llama.cpp engine and the client's llama.cpp drafter.

One :class:`LlamaModel` is one loaded model with one context of ``n_seqs`` sequences, in one
unified KV cache or a KV stream each. A :meth:`LlamaModel.decode` call writes the new tokens of
many sequences in ONE ``llama_decode`` (split only where the tokens exceed the context's batch
size; ``exact`` splits otherwise) and returns the logits rows asked for, as float32 numpy
arrays. Positions are explicit, so a sequence's cached tokens beyond its committed prefix are
dropped with :meth:`LlamaModel.remove` (rollback); beam search saves and restores sequences.

``llama-cpp-python`` is an optional dependency (the ``[llama]`` extra): it is imported when a
model is loaded, never at module import.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.machine_cache import cpu_name, file_stamp, read_json, specdec_home, update_json
from shared.models.catalog import (
    OFFLINE_MODELS,
    ModelSpecError,
    offline_gguf_path,
    offline_model_dir,
)

log = logging.getLogger(__name__)

_BACKEND_LOCK = threading.Lock()
GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT
GGML_TYPE_F32 = 0
_backend_ready = False


Token = tuple[int, int, int, bool]  # sequence, position, id, whether its logits row is kept


@dataclass(frozen=True)
class Segment:
    """New tokens for one sequence, at positions ``start``, ``start + 1``, ...; ``rows_from``:
    return the logits at ``token_ids[rows_from:]`` (None: no rows); ``steps_from``: under
    ``exact``, ``token_ids[steps_from:]`` are written in the layout of rows, as the steps that
    generated them wrote them, not as a prompt (a reopened session's history)."""

    seq: int
    start: int
    token_ids: list[int]
    rows_from: int | None = None
    steps_from: int | None = None


def is_gguf(spec: str) -> bool:
    return spec.endswith(".gguf")


def llama_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def kept_gguf(short_name: str) -> Path | None:
    """The assembled GGUF file of a short name of the offline pair, where it is kept."""
    if short_name not in OFFLINE_MODELS:
        return None
    path = offline_gguf_path(short_name)
    return path if path.is_file() else None


def resolve_gguf(spec: str) -> tuple[str, str]:
    """``(gguf file, tokenizer spec)`` of a .gguf path or a short name of the offline pair
    (its GGUF kept by ``shared/models/fetch.py``; the tokenizer from its folder, converted
    or tokenizer-only, when it is there, which loads faster than the GGUF's own vocabulary)."""
    if spec in OFFLINE_MODELS:
        path = offline_gguf_path(spec)
        if not path.is_file():
            raise ModelSpecError(f"the GGUF file of {spec!r} is not kept here: run "
                                 f"`python shared/models/fetch.py --keep-gguf` (looked for "
                                 f"{path})")
        folder = offline_model_dir(spec)
        tokenizer = (folder / "config.json").exists() or (folder / "tokenizer.json").is_file()
        return str(path), spec if tokenizer else str(path)
    if not is_gguf(spec):
        raise ModelSpecError(f"the llama-cpp engine loads a .gguf file or a short name of the "
                             f"offline pair ({', '.join(OFFLINE_MODELS)}); got {spec!r}")
    return spec, spec


def _library() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - the [llama] extra is installed in tests
        raise ModelSpecError("the llama-cpp engine needs llama-cpp-python: "
                             "pip install 'specdec[llama]'") from exc
    global _backend_ready
    with _BACKEND_LOCK:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            if not os.environ.get("SPECDEC_LLAMA_LOG"):
                _silence(llama_cpp)
            _backend_ready = True
    return llama_cpp


_log_callback: Any = None  # kept alive: llama.cpp holds the pointer


def _silence(llama_cpp: Any) -> None:
    """llama.cpp logs every load to stderr; keep its errors only (SPECDEC_LLAMA_LOG=1: all)."""
    global _log_callback

    @llama_cpp.llama_log_callback
    def quiet(level: int, text: bytes, _user: Any) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            os.write(2, text)

    _log_callback = quiet
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))


@functools.cache
def extra_buffer_types() -> tuple[str, ...]:
    """The weight layouts llama.cpp's CPU backend offers beside its plain one (``AMX``,
    ``CPU_REPACK``, ...): the weights it repacks into them at load run its faster kernels."""
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(folder / "libggml-base.so"))
    cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"))
    cpu.ggml_backend_cpu_reg.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    reg = cpu.ggml_backend_cpu_reg()
    address = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return ()
    listing = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    found = listing(base.ggml_backend_reg_dev_get(reg, 0))
    names: list[str] = []
    while found and found[len(names)]:
        names.append(base.ggml_backend_buft_name(found[len(names)]).decode())
    return tuple(names)


# Loads a GGUF with llama.cpp's defaults, prints whether weights went into the AMX layout, then
# decodes one 4-token batch (a multi-token decode is what runs the AMX tile kernels) and prints
# its return code.
_AMX_PROBE = """
import ctypes, sys
import llama_cpp as L
L.llama_backend_init()
used = []
@L.llama_log_callback
def hear(level, text, user):
    used.append(b"AMX model buffer" in text)
L.llama_log_set(hear, ctypes.c_void_p(0))
params = L.llama_model_default_params()
params.n_gpu_layers = 0
model = L.llama_model_load_from_file(sys.argv[1].encode(), params)
cp = L.llama_context_default_params()
cp.n_ctx = 64
cp.n_threads = cp.n_threads_batch = int(sys.argv[2])
ctx = L.llama_init_from_model(model, cp) if model else None
if ctx:
    print("amx" if any(used) else "no-amx", flush=True)
    tokens = (ctypes.c_int32 * 4)(1, 2, 3, 4)
    print(L.llama_decode(ctx, L.llama_batch_get_one(tokens, 4)), flush=True)
"""


def probe_amx(path: str, threads: int) -> str:
    """Run :data:`_AMX_PROBE` in a child: ``amx-ran``, ``amx-failed`` (a crash, an error code
    or a hang), ``no-amx`` (no weight of ``path`` in the AMX layout) or ``not-loaded``."""
    try:
        done = subprocess.run([sys.executable, "-c", _AMX_PROBE, path, str(threads)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "amx-failed"
    said = done.stdout.split()
    if not said:
        return "not-loaded"
    if said[0] != "amx":
        return "no-amx"
    return "amx-ran" if done.returncode == 0 and said[1:] == ["0"] else "amx-failed"


def amx_cache_path() -> Path:
    """``$SPECDEC_LLAMA_AMX_CACHE``, else ``$SPECDEC_HOME/llama-cpp-amx.json``."""
    return Path(os.environ.get("SPECDEC_LLAMA_AMX_CACHE")
                or specdec_home() / "llama-cpp-amx.json")


def _amx_machine_key() -> str:
    import llama_cpp

    return f"{cpu_name()}|llama-cpp-python={llama_cpp.__version__}"


def cost_key(model: LlamaModel) -> str:
    """What a timing of this model's forwards depends on: the file, the machine, the
    llama-cpp-python version, the weights' layouts, the threads, the kernels (exact: at most
    3 rows a decode) and the sequence's length."""
    return (f"{file_stamp(model.weights.path)}|{_amx_machine_key()}"
            f"|repacked={model.weights.extra_layouts}|threads={model.threads}"
            f"|exact={model.exact}|context={model.seq_tokens}")




def amx_works(path: str, threads: int) -> bool | None:
    """Whether llama.cpp's AMX kernels run on this machine: True / False as measured here once
    (per machine and llama-cpp-python version, kept in :func:`amx_cache_path`), None when
    ``path`` puts no weight in the AMX layout (remembered per file: nothing of it runs them).
    They crash some machines that report AMX (a virtual machine here: a segmentation fault in
    the first multi-token decode, as in llama.cpp issue 20824), so they are tried in a child
    process, never in this one. ``SPECDEC_LLAMA_AMX=0`` / ``1`` decides without trying."""
    setting = os.environ.get("SPECDEC_LLAMA_AMX", "auto")
    if setting in ("0", "1"):
        return setting == "1"
    machine, file = _amx_machine_key(), file_stamp(path)
    data = read_json(amx_cache_path(), "llama.cpp's AMX probe")
    known, no_amx = data.get(machine), data.get("no-amx", {})
    if isinstance(known, bool):
        return known
    if isinstance(no_amx, dict) and no_amx.get(file) is True:
        return None
    if known is not None or not isinstance(no_amx, dict):
        log.warning("ignoring what %s says of this machine or file (not what a probe "
                    "writes): probing again", amx_cache_path())
    outcome = probe_amx(path, threads)
    if outcome not in ("no-amx", "amx-ran", "amx-failed"):
        return None

    def keep(data: dict[str, Any]) -> None:  # what another process wrote meanwhile stays
        if outcome == "no-amx":
            files = data.get("no-amx")
            if not isinstance(files, dict):
                files = data["no-amx"] = {}
            files[file] = True
        else:
            data[machine] = outcome == "amx-ran"

    update_json(amx_cache_path(), keep, "llama.cpp's AMX probe")
    if outcome == "amx-failed":
        log.warning("llama.cpp's AMX kernels fail on this machine (tried once in a child "
                    "process): GGUF weights stay in llama.cpp's plain layout here "
                    "(SPECDEC_LLAMA_AMX=1 forces them)")
    return {"amx-ran": True, "amx-failed": False}.get(outcome)


def repacked_layouts_run(path: str, threads: int) -> bool:
    """Whether ``path`` may load into llama.cpp's repacked layouts here (its default): not
    where they include AMX and its kernels fail on this machine (:func:`amx_works`)."""
    return "AMX" not in extra_buffer_types() or amx_works(path, threads) is not False


# The most rows an exact decode gives llama.cpp at once: its CPU kernels for up to 3 rows compute
# each row alone, as for one (the repacked layouts' gemv below 4 rows; the tiled K-quant kernel
# starts at 8); more rows take kernels that share work across rows and round otherwise.
EXACT_ROWS = 3
# A prompt (the tokens a segment writes before the first row it asks for) goes in decodes of its
# own sequence alone, cut at positions that are multiples of this: whole-batch kernels, but what
# they write depends on the prompt only - never on the load, on other sequences, or on whether
# the prompt came whole (``/v1/generate``) or less its last token (a session) - so the target
# alone and a speculative session hold the same prompt cache. At most the context's ubatch (512).
PREFILL_CHUNK = 64


@functools.cache
def has_llamafile() -> bool:
    """Whether the installed llama.cpp was built with its llamafile matrix kernels (llama.cpp's
    default build): they multiply two rows and more unlike its one-row dot product, float16
    attention included, so a verify block cannot round like one-token steps there."""
    import llama_cpp

    cpu = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    probe = getattr(cpu, "ggml_cpu_has_llamafile", None)
    return bool(probe()) if probe is not None else True


def exact_kernels() -> tuple[bool, str]:
    """Whether this process's llama.cpp computes every row of a decode like a one-token step
    (the engine's ``kernels="exact"``), and if not, why."""
    _library()
    if has_llamafile():
        return False, ("this llama-cpp-python was built with llamafile's kernels (build it "
                       "with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF, as `make install` does)")
    return True, (f"at most {EXACT_ROWS} rows per llama_decode (one-row kernels), one KV "
                  "stream per sequence")


class GGUFWeights:
    """A GGUF model's weights loaded by llama.cpp (memory-mapped), shared by its contexts.
    ``plain``: keep llama.cpp's plain weight layout, not the repacked ones it offers here."""

    def __init__(self, path: str, threads: int = 0, plain: bool = False) -> None:
        if not Path(path).is_file():
            raise ModelSpecError(f"GGUF file {path!r} does not exist")
        self.path = path
        lib = self.lib = _library()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # Repacked layouts (llama.cpp's default) only where they run: AMX's are tried first.
        self.extra_layouts = not plain and repacked_layouts_run(path, threads or default_threads())
        model_params.use_extra_bufts = self.extra_layouts
        self.model = lib.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise ModelSpecError(f"llama.cpp cannot load {path!r}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        self.model_limit = int(lib.llama_model_n_ctx_train(self.model))

    def meta(self, key: str) -> str | None:
        """A GGUF metadata string (``general.name``, ``tokenizer.ggml.eos_token_id``, ...)."""
        buf = ctypes.create_string_buffer(512)
        size = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if size >= 0 else None

    def kv_bytes_per_token(self) -> int:
        """Keys and values of one cached token over all layers, in a float16 cache."""
        arch = self.meta("general.architecture") or "llama"

        def number(key: str, default: int) -> int:
            value = self.meta(f"{arch}.{key}")
            return int(value) if value and value.isdigit() else default

        heads = number("attention.head_count", 1)
        head_dim = number("attention.key_length", number("embedding_length", 0) // heads)
        kv_heads = number("attention.head_count_kv", heads)
        return number("block_count", 0) * 2 * kv_heads * head_dim * 2

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        with contextlib.suppress(Exception):
            if getattr(self, "model", None):
                self.lib.llama_model_free(self.model)
                self.model = None


class LlamaModel:
    """A context on GGUF weights (a path, or :class:`GGUFWeights` shared with other contexts)
    holding ``n_seqs`` sequences of up to ``seq_tokens`` each, in a unified cache of ``cells``
    tokens (default ``n_seqs * seq_tokens``) or, with ``streams``, a KV stream each (llama.cpp's
    server lays out ``-np N`` so: a sequence attends over its own cells only).

    ``exact``: every row a decode returns is bit-equal to what one-token steps return, whatever
    the batch: one KV stream of ``seq_tokens`` cells per sequence (position p of a sequence
    always lies in its stream's cell p, whatever other sequences did, so attention sums the same
    cells in the same order), every token whose row is asked for goes to llama.cpp at most
    :data:`EXACT_ROWS` rows per ``llama_decode``, and a prompt (the tokens before a segment's
    first row) in whole batches of its own sequence, cut at multiples of
    :data:`PREFILL_CHUNK`, so the cache it leaves depends on the prompt alone. Not
    thread-safe: one caller at a time (the verifier's model thread, or one drafter)."""

    def __init__(self, weights: str | GGUFWeights, n_seqs: int = 1, seq_tokens: int = 4096,
                 threads: int = 0, batch_tokens: int = 2048, cells: int = 0,
                 exact: bool = False, streams: bool | None = None) -> None:
        self.weights = (weights if isinstance(weights, GGUFWeights)
                        else GGUFWeights(weights, threads))
        lib = self.lib = self.weights.lib
        self.model = self.weights.model
        self.vocab_size, self.model_limit = self.weights.vocab_size, self.weights.model_limit
        self.seq_tokens = min(seq_tokens, self.model_limit) if seq_tokens else self.model_limit
        self.n_seqs = n_seqs
        self.threads = threads or default_threads()
        self.exact = exact
        # a KV stream per sequence (exact needs them; whole batches may use them too)
        self.streams = exact or bool(streams)
        params = lib.llama_context_default_params()
        params.n_ctx = (n_seqs * self.seq_tokens if self.streams
                        else cells or n_seqs * self.seq_tokens)
        params.n_seq_max = n_seqs
        params.n_batch = self.batch_tokens = max(1, min(batch_tokens, params.n_ctx))
        params.n_ubatch = min(512, self.batch_tokens)
        params.n_threads = params.n_threads_batch = self.threads
        # A float32 file keeps a float32 cache (then its logits are transformers' to 1e-5);
        # any other keeps llama.cpp's default float16 cache.
        self.kv_f32 = self.meta("general.file_type") == "0"
        if self.kv_f32:
            params.type_k = params.type_v = GGML_TYPE_F32
        # unified: one pool of cells that any sequence may use; exact: a stream per sequence
        params.kv_unified = not self.streams
        params.no_perf = True
        # Off: its CPU kernel rounds by where a sequence's cells lie in the cache (a beam's
        # scores then depend on which slot it sits in), and it was not faster here
        # (docs/benchmarks.md, llama.cpp section).
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ModelSpecError(f"llama.cpp cannot make a context of {params.n_ctx} tokens "
                                 f"for {self.weights.path!r}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))
        self.nbytes = self.n_ctx * self.weights.kv_bytes_per_token() * (2 if self.kv_f32 else 1)
        self._batch = lib.llama_batch_init(self.batch_tokens, 0, 1)
        self.forwards = 0  # decode() calls: batched forwards
        self.decodes = 0  # llama_decode calls made (an exact forward makes several)

    def meta(self, key: str) -> str | None:
        return self.weights.meta(key)

    # -- the cache
    def decode(self, segments: list[Segment]) -> list[np.ndarray | None]:
        """Write every segment's tokens into its sequence (its cached positions from ``start``
        on are dropped first: a rollback); return the logits rows ([rows, vocab] float32) of
        the segments that asked, in order."""
        order, calls = self._plan(segments)
        for seq, pos, token, _ in (t for call in calls for t in call):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} outside the vocabulary of {self.vocab_size}")
            if not 0 <= seq < self.n_seqs or pos >= self.seq_tokens:
                raise ValueError(f"position {pos} of sequence {seq} outside the context")
        for s in segments:
            self.remove(s.seq, s.start)
        self.forwards += 1
        gathered: list[np.ndarray] = []
        for chunk in calls:
            batch = self._batch
            for i, (seq, pos, token, rows) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = rows
            batch.n_tokens = len(chunk)
            code = self.lib.llama_decode(self.ctx, batch)
            self.decodes += 1
            if code != 0:
                raise RuntimeError(f"llama_decode failed ({code}): "
                                   + ("no room in the KV cache" if code == 1 else "see its log"))
            outputs = sum(1 for *_, rows in chunk if rows)
            if outputs:
                pointer = self.lib.llama_get_logits(self.ctx)
                gathered.append(np.ctypeslib.as_array(
                    pointer, shape=(outputs, self.vocab_size)).copy())
        rows_all = np.concatenate(gathered) if gathered else np.zeros((0, self.vocab_size),
                                                                      np.float32)
        results: list[np.ndarray | None] = [None] * len(segments)
        offset = 0
        for j in order:
            s = segments[j]
            if s.rows_from is None:
                continue
            count = max(len(s.token_ids) - s.rows_from, 0)
            results[j] = rows_all[offset:offset + count]
            offset += count
        return results

    def _plan(self, segments: list[Segment]) -> tuple[list[int], list[list[Token]]]:
        """The segments in the order their tokens are written, and the ``llama_decode`` calls
        that write them: chunks of the context's batch size, or under ``exact`` first each
        segment's prompt alone in :func:`_aligned` runs (a session writes its prompt less its
        last token, then that token with its first drafts; ``/v1/generate`` writes it whole
        asking for the last row: both cut the same prompt in the same places), then every row
        in sequence order, :data:`EXACT_ROWS` a call."""
        def tokens(j: int) -> list[Token]:
            s = segments[j]
            return [(s.seq, s.start + i, token, s.rows_from is not None and i >= s.rows_from)
                    for i, token in enumerate(s.token_ids)]

        def chunks(flat: list[Token], size: int) -> list[list[Token]]:
            return [flat[at:at + size] for at in range(0, len(flat), size)]

        if not self.exact:
            order = list(range(len(segments)))
            return order, chunks([t for j in order for t in tokens(j)], self.batch_tokens)
        # In sequence order: llama.cpp splits a multi-stream batch into ubatches of
        # consecutive sequences, so neighbours share one.
        order = sorted(range(len(segments)), key=lambda j: segments[j].seq)
        prompts: list[list[Token]] = []
        rows: list[Token] = []
        for j in order:
            written = tokens(j)
            head = _prompt_length(segments[j])
            prompts += _aligned(written[:head], PREFILL_CHUNK)
            rows += written[head:]
        return order, prompts + chunks(rows, EXACT_ROWS)

    def remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        """Drop sequence ``seq``'s cached positions [start, end) (end -1: to its end)."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, end)

    def save(self, seq: int) -> Any:
        """Sequence ``seq``'s cached keys and values, as llama.cpp serializes them."""
        size = int(self.lib.llama_state_seq_get_size(self.ctx, seq))
        state = (ctypes.c_uint8 * max(size, 1))()
        if self.lib.llama_state_seq_get_data(self.ctx, state, size, seq) != size:
            raise RuntimeError(f"llama.cpp could not save sequence {seq}")
        return state

    def restore(self, seq: int, state: Any) -> None:
        """Sequence ``seq`` holds what :meth:`save` took (its own cells dropped first)."""
        self.remove(seq)
        if self.lib.llama_state_seq_set_data(self.ctx, state, len(state), seq) == 0:
            raise RuntimeError(f"llama.cpp could not restore sequence {seq}")

    def length(self, seq: int) -> int:
        """Cached positions of ``seq`` (its largest position + 1)."""
        return int(self.lib.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        with contextlib.suppress(Exception):
            self.close()


def _prompt_length(segment: Segment) -> int:
    """The tokens at the front of ``segment`` that ask for no row and were not written by
    steps: its prompt."""
    ends = [len(segment.token_ids), segment.rows_from, segment.steps_from]
    return min(end for end in ends if end is not None)


def _aligned(written: list[Token], size: int) -> list[list[Token]]:
    """One sequence's tokens in runs that end where a position is a multiple of ``size``: the
    same prompt is cut in the same places however it is written."""
    runs: list[list[Token]] = []
    for token in written:
        if not runs or token[1] % size == 0:
            runs.append([])
        runs[-1].append(token)
    return runs


def default_threads() -> int:
    """Threads llama.cpp should use: ``OMP_NUM_THREADS`` where it is set (the budget PyTorch's
    engines already keep to), else every core this process may run on. More threads than free
    cores costs far more than it gains: llama.cpp's threads spin at each operation's barrier,
    so one descheduled thread stalls the others for a scheduler tick."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    if budget.isdigit() and int(budget) > 0:
        return int(budget)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
