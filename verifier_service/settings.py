"""Verifier settings: the one source of every option.

Read from ``SPECDEC_*`` environment variables; ``specdec-verifier`` builds its command line from
the same fields (``--max-batch-size`` for ``max_batch_size``; booleans as ``--batching`` /
``--no-batching``), and flags win over the environment. ``docs/configuration.md`` lists them,
and a test checks that table against this class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, CliSuppress, SettingsConfigDict

if TYPE_CHECKING:
    from shared.engines.target import Engine, TargetOptions


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="SPECDEC_", extra="ignore", cli_prog_name="specdec-verifier",
        cli_kebab_case=True, cli_implicit_flags="dual", cli_avoid_json=True,
        cli_exit_on_error=True,
    )

    model: str = Field("qwen2.5-coder-1.5b", description="the target: short name of the "
                       "offline pair, local folder, .gguf file or hub id")
    engine: Literal["auto", "transformers", "llama-cpp", "int8", "w4a8"] = Field(
        "auto", description="what runs the target: transformers (any device), or llama.cpp "
        "for a .gguf file or a short name whose GGUF is kept (CPU; needs the [llama] extra), "
        "or int8: a Llama / Qwen2-family model transformers loads, its weights in int8 on the "
        "CPU, or w4a8: a Qwen2 / Llama GGUF file's own Q4_K / Q6_K weights on the CPU, by one "
        "batch-invariant kernel (int8 and w4a8: verify blocks much cheaper than their tokens "
        "one by one, every row exact); auto: w4a8 on a CPU for a GGUF file it computes (or a "
        "short name whose GGUF is kept), else llama.cpp for other GGUF files, else "
        "transformers")
    dtype: Literal["auto", "fastest", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the transformers engine's dtype. auto: float32 on a CPU (in "
        "bfloat16 a verify block rounds unlike one-token steps and greedy output may differ "
        "from the target alone's), bfloat16 on CUDA. fastest: on a CPU the faster of float32 "
        "and bfloat16 for this model, measured at its first load here and cached in "
        "$SPECDEC_DTYPE_CACHE (default $SPECDEC_HOME/dtype-choices.json); bfloat16 on CUDA, "
        "for GGUF files and encoder-decoders")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    device_map: str = Field("", description="a target larger than one device: accelerate's "
                            "placement (auto, balanced, sequential: over the GPUs, then CPU "
                            "offload) or a JSON {module: device} map; empty: all on --device")
    offload_folder: str = Field("", description="with --device-map: where modules placed on "
                                "\"disk\" are kept")
    tp_plan: str = Field("", description="tensor parallel: \"auto\" shards the target over "
                         "the ranks of a torchrun group (rank 0 serves); empty: off")
    threads: int = Field(0, ge=0, description="the engine's CPU threads (torch intra-op, or "
                         "llama.cpp's); 0: torch's default, or every core llama.cpp may use")
    kernels: Literal["exact", "fast"] = Field(
        "exact", description="the llama-cpp engine's kernels. exact: every row of a verify "
        "block computed as a one-token step computes it (at most 3 rows per llama_decode, "
        "one-row kernels; prompts alone in whole batches cut at fixed positions; one KV stream "
        "per session), so greedy output equals the target alone's token for token at any k and "
        "load. fast: llama.cpp's whole batches (multi-row kernels, a KV stream per session, as "
        "llama-server -np N lays them out): cheaper blocks and batches of 4 rows and more, but "
        "greedy output may differ from the target alone's, from run to run and with load")
    int8_outliers: int = Field(
        0, ge=0, le=64, description="the int8 engine: each row's this many largest values "
        "(rounded down to a power of two) are taken out before the row's activations are "
        "quantized, so they do not set its scale (attention and MLP down projections: "
        "multiplied in float32; output head: quantized as a row of their own); measured: "
        "with 8, top-token agreement with bf16 97.1% -> 98.4% (Q4_K_M: 98.1%), and forwards "
        "cost 1.04x (one token) to 1.75x (8 sessions x 16 tokens); 0: the cheapest blocks")
    expected_sessions: int = Field(
        1, ge=1, description="--engine auto, where llama.cpp and the int8 engine can both serve "
        "the target: how many sessions you expect to draft at once; auto picks the engine "
        "whose recorded verify costs (every start records them, in "
        "$SPECDEC_HOME/engine-costs.json) give the fewest ms per output token for that work")
    expected_acceptance: float = Field(
        0.0, ge=0.0, lt=1.0, description="--engine auto: the acceptance you expect of a "
        "drafted token (0: text where nothing can be drafted; a verify block then yields one "
        "token, and the cheaper one-token step wins)")
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="bind port")

    max_sessions: int = Field(64, ge=1, description="LRU-evicts the least recently used beyond")
    session_ttl_s: float = Field(600.0, gt=0, description="idle sessions older than this expire")
    session_protect_s: float = Field(2.0, ge=0, description="a session is safe from eviction "
                                     "for this long after its last call (longer for a slow "
                                     "client: 4 x its mean interval between calls); a create "
                                     "that finds every slot so protected gets 503 + Retry-After")
    max_draft_tokens: int = Field(16, ge=0, description="largest k a verify call may send")
    max_context: int = Field(4096, ge=0, description="tokens one session may hold; "
                             "0: the model's max_position_embeddings")
    kv_budget_tokens: int = Field(0, ge=0, description="KV pool size in tokens, shared by the "
                                  "sessions (each holds a region of 256, 512, ... up to "
                                  "max_context tokens, grown as it needs); when it is full the "
                                  "least recently used idle session is evicted; 0: on CUDA what "
                                  "kv_memory_fraction of the device leaves free after the "
                                  "model, elsewhere 65536")
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="with kv_budget_tokens 0 "
                                      "on CUDA: the share of the device's memory the model, "
                                      "its activations and the KV pool may use together")
    batching: bool = Field(True, description="batch concurrent calls into one forward pass")
    max_batch_size: int = Field(16, ge=1, description="jobs per batched forward")
    max_batch_tokens: int = Field(2048, ge=1, description="tokens per batched forward")
    batch_wait_ms: float = Field(10.0, ge=0, description="how long a batch may wait for "
                                 "sessions active in the last second that are not in it yet")
    max_queue: int = Field(256, ge=1, description="queued jobs; beyond it 429 + Retry-After")
    acceptance: Literal["device", "host"] = Field(
        "device", description="device: decide every verify block of a batch in one vectorised "
        "step next to the logits; host: copy each block's rows to the host (the reference)")
    attention: Literal["auto", "padded", "per-session"] = Field(
        "auto", description="padded: a batch's short blocks attend in one call per layer; "
        "per-session: one call per session; auto: padded on CUDA, per-session on CPU")
    cuda_graphs: bool = Field(False, description="short batches (blocks of up to 16 drafts) "
                              "run in static-shape buckets replayed as CUDA graphs (on CPU: the "
                              "same layout, eagerly); one KV slot is kept for padding")
    max_new_tokens: int = Field(1024, ge=1, description="cap for /v1/generate")
    max_prompt_tokens: int = Field(0, ge=0, description="longest prompt; 0: max_context - 1")
    replica_name: str = Field("", description="sent as X-Verifier-Replica; default host:port")

    # Environment only (SPECDEC_API_KEYS): a flag would show the keys in `ps`.
    api_keys: CliSuppress[str] = Field(
        "", repr=False, description="comma-separated API keys; empty: no auth. Clients send "
        "one as 'Authorization: Bearer KEY' (or X-API-Key); /healthz and /readyz stay open")
    max_sessions_per_key: int = Field(0, ge=0, description="open sessions one API key may "
                                      "hold (0: only max_sessions applies); beyond it 429")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body; "
                                "beyond it 413")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM: stop accepting, "
                                    "let calls in flight finish for up to this long, then exit")
    max_connections: int = Field(512, ge=1, description="open connections; a new one beyond "
                                 "it closes the one that waited longest for a request head "
                                 "(503 when all are busy)")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a "
                                    "complete request head within this long of connecting or of "
                                    "its last response; else 408 and closed")
    body_timeout_s: float = Field(15.0, gt=0, description="a request body must arrive within "
                                  "this long; else 408 and closed")
    http_parser: Literal["auto", "httptools", "h11"] = Field(
        "auto", description="the HTTP/1.1 parser: httptools (C) where installed, else h11")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is "
                                "closed after this long")

    def key_list(self) -> list[str]:
        return [key.strip() for key in self.api_keys.split(",") if key.strip()]

    def target_options(self) -> TargetOptions:
        """What the engine loads the target with."""
        from shared.engines.target import TargetOptions

        static_batch = (self.max_batch_size if self.batching else 1) if self.cuda_graphs else 0
        return TargetOptions(
            model=self.model, dtype=self.dtype, device=self.device, max_context=self.max_context,
            kv_budget_tokens=self.kv_budget_tokens, threads=self.threads,
            acceptance=self.acceptance, max_batch_tokens=self.max_batch_tokens,
            kernels=self.kernels, int8_outliers=self.int8_outliers, device_map=self.device_map,
            offload_folder=self.offload_folder,
            tp_plan=self.tp_plan, static_batch=static_batch,
            static_length=self.max_draft_tokens + 1, attention=self.attention,
            kv_memory_fraction=self.kv_memory_fraction)

    def engine_name(self) -> str:
        """``engine``, with ``auto`` kept to transformers where only it can place the model
        (``device_map``, ``tp_plan``, ``cuda_graphs``)."""
        placed = bool(self.device_map or self.tp_plan or self.cuda_graphs)
        return "transformers" if self.engine == "auto" and placed else self.engine

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_context and self.max_prompt_tokens >= self.max_context:
            raise ValueError(f"max_prompt_tokens {self.max_prompt_tokens} must be below "
                             f"max_context {self.max_context} (the prompt and at least one "
                             "new token share one KV slot)")
        if self.engine in ("llama-cpp", "int8", "w4a8"):
            for name in ("device_map", "tp_plan"):
                if getattr(self, name):
                    raise ValueError(f"{name} places a transformers target; the "
                                     f"{self.engine} engine runs on the CPU")
            if self.cuda_graphs:
                raise ValueError("cuda_graphs is for the transformers engine on CUDA; the "
                                 f"{self.engine} engine runs on the CPU")
            if self.device not in ("auto", "cpu"):
                raise ValueError(f"device {self.device!r}: the {self.engine} engine runs on "
                                 "the CPU")
        if self.tp_plan and self.device_map:
            raise ValueError("tp_plan and device_map are two ways to place one model: choose "
                             "one")
        return self


class SettingsError(ValueError):
    """A setting that does not fit the loaded model; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"--{field.replace('_', '-')} (SPECDEC_{field.upper()}): {message}")
        self.field = field


def load_engine(settings: Settings) -> Engine:
    """The target of ``settings``, on the engine they resolve to (``shared/engines``), loaded,
    warmed up and ready to serve; its verify costs are kept for ``--engine auto``'s choice."""
    from dataclasses import replace

    from shared.engines import backend, resolve
    from shared.engines.choice import Workload, choose, record_costs, recorded_costs
    from shared.engines.int8 import can_serve

    name, why = settings.engine_name(), ""
    if name == "auto":
        name = resolve("auto", settings.model, settings.device).name
        if name == "llama-cpp" and can_serve(settings.model):
            choice = choose(["llama-cpp", "int8"],
                            recorded_costs(settings.model, settings.threads),
                            Workload(settings.expected_sessions, settings.expected_acceptance))
            name, why = choice.engine, choice.why
    engine = backend(name).load_target(settings.target_options())
    if name in ("llama-cpp", "int8", "w4a8"):
        record_costs(settings.model, settings.threads, name, engine.info.verify_ms)
    engine.info = replace(engine.info, engine=name, engine_choice=why)
    return engine


def check_against_model(settings: Settings, max_context: int, model_limit: int) -> None:
    """Refuse settings the loaded model cannot honour (``max_context``: the effective one)."""
    if settings.max_prompt_tokens and settings.max_prompt_tokens >= max_context:
        raise SettingsError("max_prompt_tokens", f"{settings.max_prompt_tokens} must be below "
                            f"the context of {max_context} tokens per session (the model's "
                            f"limit is {model_limit})")


def settings_table() -> str:
    """The Markdown table of every setting (docs/configuration.md holds this exact text)."""
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        env = f"`SPECDEC_{name.upper()}`"
        if name == "api_keys":
            flag = "(environment only)"
        elif field.annotation is bool:
            flag = f"`--{name.replace('_', '-')}` / `--no-{name.replace('_', '-')}`"
        else:
            flag = f"`--{name.replace('_', '-')}`"
        default = "empty" if field.default == "" else f"`{field.default}`"
        lines.append(f"| {flag} | {env} | {default} | {field.description or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(settings_table())
