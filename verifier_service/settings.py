"""Verifier settings: one class, read from SPECDEC_* environment variables and CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore")

    model: str = Field("qwen2.5-coder-1.5b", description="short name, folder, .gguf file or hub id")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    max_sessions: int = Field(64, ge=1, description="LRU-evicts the least recently used beyond")
    session_ttl_s: float = Field(600.0, gt=0, description="idle sessions older than this expire")
    max_draft_tokens: int = Field(16, ge=0, description="largest k a verify call may send")
    max_context: int = Field(0, ge=0, description="0: the model's max_position_embeddings")
    max_new_tokens: int = Field(1024, ge=1, description="cap for /v1/generate")
    max_prompt_tokens: int = Field(0, ge=0, description="0: max_context - 1")
    replica_name: str = Field("", description="sent as X-Verifier-Replica; default host:port")
