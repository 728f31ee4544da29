"""The one settings object, read from the environment at the entry points and passed down.

Generic job settings (leases, attempts, time limits) sit here; each kind of work declares
its own group beside it (sdq.models.<kind>.settings, named by its ModelHooks), read with
them. Time limits can be set per queue, since a training task runs far longer than a
generation batch.
"""

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from sdq.models.jobs.kinds import KINDS, QUEUES

N = TypeVar("N", int, float)
G = TypeVar("G")

EMBEDDED_HOME = Path("sdq-data")


def setting(
    name: str,
    default: object,
    *,
    minimum: int = 1,
    read: Callable[[Mapping[str, str], str, object], object] | None = None,
) -> Any:
    """A setting, declared once: its environment variable, default and lower bound (for a
    whole number), or how it is read when its type says too little (`read(env, name,
    default)`). A float is a duration in seconds above 0, a bool on or off (1 or 0); text
    is taken as it is."""
    return field(default=default, metadata={"env": name, "minimum": minimum, "read": read})


def read_group(group: type[G], env: Mapping[str, str]) -> G:
    """A group of settings, each read from its variable (its default when unset)."""
    values = {}
    for declared in fields(group):  # type: ignore[arg-type]
        name, default = declared.metadata["env"], declared.default
        read = declared.metadata["read"]
        if read is not None:
            values[declared.name] = read(env, name, default)
        elif declared.type is int:
            minimum = declared.metadata["minimum"]
            values[declared.name] = read_int(env, name, default, minimum=minimum)
        elif declared.type is float:
            values[declared.name] = _seconds(env, name, default)
        elif declared.type is bool:
            values[declared.name] = _flag(env, name, default)
        else:
            values[declared.name] = env.get(name) or default
    return group(**values)


def read_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    return _number(env, name, default, int, "an integer", lambda value: value >= minimum,
                   f"at least {minimum}")  # fmt: skip


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """On or off: 1, true, yes, on; 0, false, no, off."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be on or off (1 or 0), got {env[name]!r}")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration in seconds, fractions allowed (`2.5`), more than 0."""
    return _number(env, name, default, float, "a number of seconds",
                   lambda value: 0 < value < float("inf"), "above 0")  # fmt: skip


def _number(
    env: Mapping[str, str],
    name: str,
    default: N,
    parse: Callable[[str], N],
    what: str,
    fits: Callable[[N], bool],
    bound: str,
) -> N:
    """A number read from the environment: `default` when unset, else `what`, within `bound`."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if not fits(value):
        raise ValueError(f"{name} must be {what} {bound}, got {raw!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class TimeLimits:
    """Celery's limits for one queue's tasks: the soft one raises in the task, the hard
    one kills the process."""

    soft: int = 1800
    hard: int = 1860


@dataclass(frozen=True, kw_only=True)
class JobSettings:
    """What every kind of work shares: leases, attempts and retries."""

    lease_seconds: int = setting("SDQ_LEASE_SECONDS", 120)
    max_attempts: int = setting("SDQ_MAX_ATTEMPTS", 3)
    retry_backoff_seconds: int = setting("SDQ_RETRY_BACKOFF_SECONDS", 5)
    # Doubling, with full jitter, up to this: a database outage of hours is retried every
    # ten minutes at most. A job back from a long outage may wait up to this long.
    retry_backoff_max_seconds: int = setting("SDQ_RETRY_BACKOFF_MAX_SECONDS", 600)
    # An outage of a dependency (the object store unreachable) does not use up attempts,
    # which are for crashes and poison: it is retried, with backoff, for this long after
    # the job's first failure.
    outage_budget_seconds: int = setting("SDQ_OUTAGE_BUDGET_SECONDS", 900, minimum=0)
    # A GPU worker whose device fails this many tasks in a row (out of memory, CUDA
    # errors) on jobs other workers then do is taken out of rotation.
    sick_after: int = setting("SDQ_SICK_AFTER", 3)


@dataclass(frozen=True, kw_only=True)
class MaintenanceSettings:
    """Beat's healing: how often it runs, and how long a queued job may wait unclaimed in
    an empty queue before it is taken for lost and sent again."""

    interval_seconds: int = setting("SDQ_MAINTENANCE_INTERVAL_SECONDS", 15)
    relay_after_seconds: int = setting("SDQ_RELAY_AFTER_SECONDS", 60)
    # The hourly rollups are recomputed this often: dashboards need minutes, not seconds.
    rollup_interval_seconds: int = setting("SDQ_ROLLUP_INTERVAL_SECONDS", 60)


@dataclass(frozen=True, kw_only=True)
class Settings:
    database_url: str
    store_url: str
    # None means embedded: no broker, work runs in the calling process (`sdq run`).
    broker_url: str | None
    model_cache_dir: Path
    jobs: JobSettings = field(default_factory=JobSettings)
    maintenance: MaintenanceSettings = field(default_factory=MaintenanceSettings)
    # Each kind's group, by its class (ModelHooks.settings).
    groups: Mapping[type, Any] = field(default_factory=dict)
    # Queue name -> its task time limits.
    time_limits: Mapping[str, TimeLimits] = field(
        default_factory=lambda: {queue: TimeLimits() for queue in QUEUES}
    )

    def group(self, group: type[G]) -> G:
        """A kind's settings group, as read from the environment (else its defaults)."""
        return self.groups.get(group) or group()

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    @property
    def visibility_timeout(self) -> int:
        # Redis re-delivers an unacknowledged message after this long, whichever queue it
        # came from: one value for the whole broker, so it must outlast the longest task,
        # or a slow task would run twice at once.
        return 2 * max(limits.hard for limits in self.time_limits.values())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        home = Path(env.get("SDQ_HOME", EMBEDDED_HOME))
        return cls(
            database_url=env.get("SDQ_DATABASE_URL") or f"sqlite:///{home / 'sdq.db'}",
            store_url=env.get("SDQ_STORE_URL") or str(home / "store"),
            broker_url=env.get("SDQ_BROKER_URL") or None,
            model_cache_dir=Path(env.get("SDQ_MODEL_CACHE") or home / "model-cache"),
            jobs=read_group(JobSettings, env),
            maintenance=read_group(MaintenanceSettings, env),
            groups={group: read_group(group, env) for group in kind_groups()},
            time_limits={queue: _time_limits(env, queue) for queue in QUEUES},
        )


def kind_groups() -> list[type]:
    """The kinds' settings groups (models/jobs/kinds.py ModelHooks.settings)."""
    return [group for kind in KINDS.values() if (group := kind.model_hooks().settings)]


def _time_limits(env: Mapping[str, str], queue: str) -> TimeLimits:
    """SDQ_<QUEUE>_TASK_TIME_LIMIT overrides SDQ_TASK_TIME_LIMIT for one queue. A hard limit
    given alone brings the soft one under it, leaving the task a moment to clean up."""
    prefix = f"SDQ_{queue.upper()}_"
    hard_name = _first_set(env, f"{prefix}TASK_TIME_LIMIT", "SDQ_TASK_TIME_LIMIT")
    soft_name = _first_set(env, f"{prefix}TASK_SOFT_TIME_LIMIT", "SDQ_TASK_SOFT_TIME_LIMIT")
    hard = read_int(env, hard_name, TimeLimits.hard)
    margin = max(1, min(60, hard // 10))
    soft = read_int(env, soft_name, max(1, min(TimeLimits.soft, hard - margin)))
    if soft > hard:
        raise ValueError(f"{soft_name} ({soft}) must not exceed {hard_name} ({hard})")
    return TimeLimits(soft=soft, hard=hard)


def _first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of the names the environment sets, else the last (the general one)."""
    return next((name for name in names if env.get(name)), names[-1])
