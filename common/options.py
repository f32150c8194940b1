"""Options every service shares, as flags and ``SPECPREFILL_<NAME>`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

SETTINGS_CONFIG = SettingsConfigDict(
    env_prefix="SPECPREFILL_", cli_kebab_case=True, cli_implicit_flags=True, cli_hide_none_type=True
)


class ServerOptions(BaseSettings):
    """Where a service listens, what it logs, and how it shuts down. Services override the default port."""

    model_config = SETTINGS_CONFIG

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, description="port to listen on")
    log_level: str = Field("info", description="debug, info, warning or error")
    drain_timeout: float = Field(30.0, ge=0, description="on SIGTERM, seconds in-flight requests may take to finish")
    log_json: bool = Field(False, description="the log line of each request as one JSON object")
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry traces to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318); the standard "
        "OTEL_* variables work too; off when neither is set",
    )


class DeviceOptions(BaseSettings):
    """Where in-process models run."""

    model_config = SETTINGS_CONFIG

    device: str | None = Field(None, description="torch device for in-process models (default: cuda if available)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
