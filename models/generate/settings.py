"""How generate workers render: batches, the pipelines they keep, the prompt caches, and what
they compile and warm up. Read with the other settings (models/settings.py)."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdq.models.settings import setting

# torch.compile's modes (no torch import here to list them).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "eager")


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
    # (with fused QKV projections, static shapes; "max-autotune" and
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
    # The U-Net's and the VAE's weights in channels-last layout where there is a GPU or
    # compiling. Off by default, by what the device check measured a worker both ways
    # (`channels_last_over_contiguous`): 0.834 on an NVIDIA H200 at batch 1, eager (the
    # layout's conversions cost more kernel launches than its convolutions save).
    channels_last: bool = setting("SDQ_CHANNELS_LAST", False)
    # A compiled worker's LoRAs: swapped into one compiled pipeline per model, an adapter
    # of this rank on its U-Net's transformer blocks (a LoRA set's ranks must add up to at
    # most this), with nothing loaded or compiled again from set to set; its U-Net works
    # this much more per call than a fused one. 0: each LoRA set fused into a pipeline of
    # its own, compiled anew (warm routing still goes by model: any LoRA set to a worker
    # warm with one). Uncompiled workers always fuse.
    lora_swap_rank: int = setting("SDQ_LORA_SWAP_RANK", 32, minimum=0)
    # `sdq serve`: how long a request waits for its images before it is answered 202 with
    # its jobs (which go on, and are cached); the most images (`n`) and steps one request
    # may ask for; each API key's requests a minute and images in flight, past which it is
    # answered 429 with Retry-After; and how long a request waits for others with the same
    # pipeline call's settings, to be rendered with them in one call (0: never).
    serve_wait_seconds: float = setting("SDQ_SERVE_WAIT_SECONDS", 60.0)
    serve_max_images: int = setting("SDQ_SERVE_MAX_IMAGES", 10)
    serve_max_steps: int = setting("SDQ_SERVE_MAX_STEPS", 150)
    serve_requests_per_minute: int = setting("SDQ_SERVE_REQUESTS_PER_MINUTE", 120)
    serve_images_in_flight: int = setting("SDQ_SERVE_IMAGES_IN_FLIGHT", 32)
    serve_batch_window_ms: int = setting("SDQ_SERVE_BATCH_WINDOW_MS", 20, minimum=0)
