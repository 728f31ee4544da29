"""The one settings object, read from the environment at the entry points and passed down."""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_HOME = Path("sdq-data")


@dataclass(frozen=True, kw_only=True)
class Settings:
    database_url: str
    store_url: str
    # None means embedded: no broker, work runs in the calling process (`sdq run`).
    broker_url: str | None
    model_cache_dir: Path
    task_soft_time_limit: int = 1800
    task_time_limit: int = 1860
    lease_seconds: int = 120
    max_attempts: int = 3
    retry_backoff_seconds: int = 5
    batch_size: int = 8
    # A task message carries this many pipeline calls, so a worker uploads one call's
    # images while it renders the next.
    calls_per_task: int = 4
    # A worker keeps this many loaded pipelines; each one costs GPU memory.
    pipeline_cache_size: int = 1

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    @property
    def visibility_timeout(self) -> int:
        # Redis re-delivers an unacknowledged message after this long; it must outlast the
        # longest task, or a slow task would run twice at once.
        return self.task_time_limit * 2

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        home = Path(env.get("SDQ_HOME", EMBEDDED_HOME))
        return cls(
            database_url=env.get("SDQ_DATABASE_URL") or f"sqlite:///{home / 'sdq.db'}",
            store_url=env.get("SDQ_STORE_URL") or str(home / "store"),
            broker_url=env.get("SDQ_BROKER_URL") or None,
            model_cache_dir=Path(env.get("SDQ_MODEL_CACHE") or home / "model-cache"),
            task_soft_time_limit=_int(env, "SDQ_TASK_SOFT_TIME_LIMIT", 1800),
            task_time_limit=_int(env, "SDQ_TASK_TIME_LIMIT", 1860),
            lease_seconds=_int(env, "SDQ_LEASE_SECONDS", 120),
            max_attempts=_int(env, "SDQ_MAX_ATTEMPTS", 3),
            retry_backoff_seconds=_int(env, "SDQ_RETRY_BACKOFF_SECONDS", 5),
            batch_size=_int(env, "SDQ_BATCH_SIZE", 8),
            calls_per_task=_int(env, "SDQ_CALLS_PER_TASK", 4),
            pipeline_cache_size=_int(env, "SDQ_PIPELINE_CACHE_SIZE", 1),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value
