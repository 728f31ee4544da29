"""The one settings object, read from the environment at the entry points and passed down.

Generic job settings (leases, attempts, time limits) sit beside one group per kind of
work; time limits can be set per queue, since a training task runs far longer than a
generation batch.
"""

import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from sdq.models.jobs.kinds import QUEUES

N = TypeVar("N", int, float)
G = TypeVar("G")

EMBEDDED_HOME = Path("sdq-data")
# torch.compile's modes (no torch import here to list them).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "eager")


def setting(
    name: str,
    default: object,
    *,
    minimum: int = 1,
    read: Callable[[Mapping[str, str], str, object], object] | None = None,
) -> Any:
    """A setting, declared once: its environment variable, default and lower bound (for a
    whole number), or how it is read when its type says too little (`read(env, name,
    default)`). A float is a duration in seconds above 0; text is taken as it is."""
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
            values[declared.name] = _int(env, name, default, minimum=declared.metadata["minimum"])
        elif declared.type is float:
            values[declared.name] = _seconds(env, name, default)
        else:
            values[declared.name] = env.get(name) or default
    return group(**values)


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    return _number(env, name, default, int, "an integer", lambda value: value >= minimum,
                   f"at least {minimum}")  # fmt: skip


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration in seconds, fractions allowed (`2.5`), more than 0."""
    return _number(env, name, default, float, "a number of seconds",
                   lambda value: 0 < value < float("inf"), "above 0")  # fmt: skip


def _count_or_none(env: Mapping[str, str], name: str, default: Any) -> int | None:
    """A count of at least 1; unset or 0: none (no bound)."""
    return _int(env, name, 0, minimum=0) or default


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


def _compile_mode(env: Mapping[str, str], name: str, default: object) -> str | None:
    """SDQ_COMPILE=1 compiles, in SDQ_COMPILE_MODE (torch.compile's modes)."""
    if env.get("SDQ_COMPILE", "0") not in ("1", "true", "yes"):
        return None
    mode = env.get(name) or "max-autotune"
    if mode not in COMPILE_MODES:
        choices = ", ".join(COMPILE_MODES)
        raise ValueError(f"{name} must be one of {choices}, got {mode!r}")
    return mode


def _compile_backend(env: Mapping[str, str], name: str, default: str) -> str:
    backend = env.get(name) or default
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    return backend


def _batches(env: Mapping[str, str], name: str, default: Any) -> tuple[int, ...]:
    """`1,2,4,8,16`: batch sizes, ascending."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        sizes = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"{name} must be batch sizes such as 1,2,4,8,16, got {raw!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{name} must be batch sizes of at least 1, got {raw!r}")
    return tuple(sizes)


def _names(env: Mapping[str, str], name: str, default: Any) -> tuple[str, ...]:
    """`a,b`: names, in order."""
    return tuple(part.strip() for part in env.get(name, "").split(",") if part.strip()) or default


def _shapes(env: Mapping[str, str], name: str, default: Any) -> tuple[tuple[int, int], ...]:
    """`512x512,768x768`: (width, height) pairs, multiples of 8."""
    shapes = []
    for part in (part.strip() for part in env.get(name, "").split(",")):
        width, _, height = part.partition("x")
        if not part:
            continue
        if not (width.isdigit() and height.isdigit()) or int(width) % 8 or int(height) % 8:
            raise ValueError(f"{name}: {part!r} is not WIDTHxHEIGHT in multiples of 8")
        shapes.append((int(width), int(height)))
    return tuple(shapes)


def _networks(env: Mapping[str, str], name: str, default: Any) -> tuple[str, ...]:
    """Comma-separated CIDRs, each checked now so a typo stops the process at start."""
    networks = tuple(part.strip() for part in env.get(name, "").split(",") if part.strip())
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            raise ValueError(f"{name}: {network!r} is not a network (e.g. 127.0.0.0/8)") from None
    return networks


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
class GenerateSettings:
    batch_size: int = setting("SDQ_BATCH_SIZE", 8)
    # A task message carries this many pipeline calls, so a worker uploads one call's
    # images while it renders the next.
    calls_per_task: int = setting("SDQ_CALLS_PER_TASK", 4)
    # A worker keeps this many loaded pipelines; each one costs GPU memory.
    pipeline_cache_size: int = setting("SDQ_PIPELINE_CACHE_SIZE", 1)
    # Texts (prompts, negative prompts) whose text-encoder output each loaded pipeline
    # keeps: 118 kB each for Stable Diffusion 1.5 in float16; 0 encodes every call anew.
    prompt_cache_size: int = setting("SDQ_PROMPT_CACHE_SIZE", 1024, minimum=0)
    # A Redis (redis://host:6379/3) that every generate worker shares text embeddings in,
    # in front of their own: a text is encoded once for all GPUs, and for every model with
    # the same text encoder. Holds at most shared_prompt_cache_size texts (158 kB each for
    # SD 2 in float16), the least recently used dropped first. None: each its own.
    prompt_cache_url: str | None = setting("SDQ_PROMPT_CACHE_URL", None)
    shared_prompt_cache_size: int = setting("SDQ_SHARED_PROMPT_CACHE_SIZE", 10_000)
    # torch.compile's mode for the U-Net and the VAE decoder, compiled once per process
    # (with fused QKV projections, channels-last, static shapes; "max-autotune" and
    # "reduce-overhead" replay CUDA graphs); None: not compiled. Each new shape compiles
    # on first use (minutes): calls are padded up to the next of compile_batches, and
    # every one of them at each of warm_shapes (width, height) compiles when the pipeline
    # loads, before it renders a job.
    compile_mode: str | None = setting("SDQ_COMPILE_MODE", None, read=_compile_mode)
    compile_batches: tuple[int, ...] = setting(
        "SDQ_COMPILE_BATCHES", (1, 2, 4, 8, 16), read=_batches
    )
    warm_shapes: tuple[tuple[int, int], ...] = setting("SDQ_WARM_SHAPES", (), read=_shapes)
    # Models (as --model names them) each generate worker process loads, and compiles at
    # warm_shapes, when it starts: it consumes no queue until they are warm, so no job
    # waits minutes behind a compilation.
    warm_models: tuple[str, ...] = setting("SDQ_WARM_MODELS", (), read=_names)
    # torch.compile's backend: "inductor" generates the kernels; "eager" only traces and
    # guards, without code generation: a deployment's shapes, warming and routing checked
    # in seconds on a CPU, at uncompiled speed.
    compile_backend: str = setting("SDQ_COMPILE_BACKEND", "inductor", read=_compile_backend)


@dataclass(frozen=True, kw_only=True)
class DownloadSettings:
    # Fetches at once per worker process: downloading waits on the network, not the CPU.
    threads: int = setting("SDQ_DOWNLOAD_THREADS", 32)
    connect_timeout: float = setting("SDQ_DOWNLOAD_CONNECT_TIMEOUT", 10.0)
    # Also the cap on one fetch: redirects, headers and body.
    read_timeout: float = setting("SDQ_DOWNLOAD_TIMEOUT", 20.0)
    # Further tries of a fetch that failed for a passing reason (timeout, reset, 429, 5xx).
    retries: int = setting("SDQ_DOWNLOAD_RETRIES", 2, minimum=0)
    max_bytes: int = setting("SDQ_DOWNLOAD_MAX_BYTES", 32 * 1024 * 1024)
    max_redirects: int = setting("SDQ_DOWNLOAD_MAX_REDIRECTS", 5, minimum=0)
    # Images with more pixels are refused before decoding: a few bytes can claim gigapixels.
    max_pixels: int = setting("SDQ_DOWNLOAD_MAX_PIXELS", 90_000_000)
    # Decoded pixels a worker process's threads hold at once: an image waits until its
    # pixels fit, so a slice of huge images takes its memory in turns, not all at once.
    # Three bytes (RGB) a pixel, plus a working copy while it is resized.
    pixel_budget: int = setting("SDQ_DOWNLOAD_PIXEL_BUDGET", 180_000_000)
    # CIDRs that may be fetched although private or local (e.g. 127.0.0.0/8 for tests).
    allow_networks: tuple[str, ...] = setting("SDQ_DOWNLOAD_ALLOW_NETWORKS", (), read=_networks)

    def __post_init__(self) -> None:
        if self.pixel_budget < self.max_pixels:
            raise ValueError(
                f"SDQ_DOWNLOAD_PIXEL_BUDGET ({self.pixel_budget}) must be at least "
                f"SDQ_DOWNLOAD_MAX_PIXELS ({self.max_pixels}): the largest image allowed "
                "must fit in it"
            )


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    # A collective that waits longer than this fails the job, which is sent again and goes
    # on from its last checkpoint: a dead or stuck rank never hangs the others.
    collective_timeout_seconds: int = setting("SDQ_TRAIN_COLLECTIVE_TIMEOUT", 600)
    # A job over several nodes waits this long for its gang to gather before it gives up
    # (for now: an outage, not a spent attempt) and is sent again.
    gang_timeout_seconds: int = setting("SDQ_TRAIN_GANG_TIMEOUT", 300)
    # A node of a gang not seen for this long (each notes itself every second) is lost:
    # its gathering fails as an outage, and the job gathers a new gang.
    node_timeout_seconds: int = setting("SDQ_TRAIN_NODE_TIMEOUT", 15)
    # Where this machine's rank 0 is reached by the other nodes of a gang; None: the
    # address its host name resolves to.
    node_address: str | None = setting("SDQ_TRAIN_NODE_ADDRESS", None)
    # Losses stay on the device and are read this many steps at a time: each read waits
    # for the device to finish its queued work.
    loss_every: int = setting("SDQ_TRAIN_LOSS_EVERY", 25)
    # Each lane's next shards fetched while its current one trains, and the threads that
    # fetch and decode them (each fetch is itself several ranged GETs at once on S3).
    shards_ahead: int = setting("SDQ_TRAIN_SHARDS_AHEAD", 1)
    fetch_threads: int = setting("SDQ_TRAIN_FETCH_THREADS", 4)
    # The most ranks a job may start on this machine (`sdq worker gpu --train-ranks N`
    # sets it for its train worker); None: as many as a job asks for.
    ranks: int | None = setting("SDQ_TRAIN_RANKS", None, read=_count_or_none)

    def too_many_ranks(self, run: int, ranks_per_node: int) -> str | None:
        """Why this machine cannot take a node of a job of that many ranks a node."""
        if self.ranks is None or ranks_per_node <= self.ranks:
            return None
        return (
            f"train run {run} trains on {ranks_per_node} ranks a node; this worker was started "
            f"with --train-ranks {self.ranks}: `sdq worker gpu --train-ranks "
            f"{ranks_per_node}` starts one that can take it"
        )


@dataclass(frozen=True, kw_only=True)
class Settings:
    database_url: str
    store_url: str
    # None means embedded: no broker, work runs in the calling process (`sdq run`).
    broker_url: str | None
    model_cache_dir: Path
    jobs: JobSettings = field(default_factory=JobSettings)
    maintenance: MaintenanceSettings = field(default_factory=MaintenanceSettings)
    generate: GenerateSettings = field(default_factory=GenerateSettings)
    download: DownloadSettings = field(default_factory=DownloadSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    # Queue name -> its task time limits.
    time_limits: Mapping[str, TimeLimits] = field(
        default_factory=lambda: {queue: TimeLimits() for queue in QUEUES}
    )

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
            generate=read_group(GenerateSettings, env),
            download=read_group(DownloadSettings, env),
            train=read_group(TrainSettings, env),
            time_limits={queue: _time_limits(env, queue) for queue in QUEUES},
        )


def _time_limits(env: Mapping[str, str], queue: str) -> TimeLimits:
    """SDQ_<QUEUE>_TASK_TIME_LIMIT overrides SDQ_TASK_TIME_LIMIT for one queue. A hard limit
    given alone brings the soft one under it, leaving the task a moment to clean up."""
    prefix = f"SDQ_{queue.upper()}_"
    hard_name = _first_set(env, f"{prefix}TASK_TIME_LIMIT", "SDQ_TASK_TIME_LIMIT")
    soft_name = _first_set(env, f"{prefix}TASK_SOFT_TIME_LIMIT", "SDQ_TASK_SOFT_TIME_LIMIT")
    hard = _int(env, hard_name, TimeLimits.hard)
    margin = max(1, min(60, hard // 10))
    soft = _int(env, soft_name, max(1, min(TimeLimits.soft, hard - margin)))
    if soft > hard:
        raise ValueError(f"{soft_name} ({soft}) must not exceed {hard_name} ({hard})")
    return TimeLimits(soft=soft, hard=hard)


def _first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of the names the environment sets, else the last (the general one)."""
    return next((name for name in names if env.get(name)), names[-1])
