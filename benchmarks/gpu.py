"""Generation as fast as the device allows: sdq's render against a plain diffusers loop.

A Stable Diffusion 1.5-shaped pipeline with random weights, built in code (benchmarks/sd15.py:
the 860M U-Net, the VAE, CLIP ViT-L/14's text tower, and SD 1.5's safety checker: CLIP
ViT-L/14's vision tower), at --size with --steps, for each batch size, in --dtype. Parts:

  loading:  the folder as a model ships (saved with its safety checker), loaded and called
            as diffusers loads it (the checker on every call) and without the checker,
            against sdq's worker (no checker by default; `--safety-check` runs it apart).
  eager:    the pipeline as built; plain `pipeline(prompt=[...], negative_prompt=[...],
            generator=[...])` as a script does, against the worker's render() (a scheduler
            from the spec per call, per-image generators, prompt embeddings kept).
  compiled: for each of --compile-modes (max-autotune replays CUDA graphs, the -no-cudagraphs
            mode does not), a fresh pipeline compiled as SDQ_COMPILE does, its batch buckets
            warmed at the shape; sdq pads each call to a bucket, the plain loop calls the
            same compiled modules with its own sizes. Counts sdq's recompilations after warm-up.
  shared:   two worker processes on the device, one Redis prompt cache (SDQ_PROMPT_CACHE_URL)
            against their own caches: texts encoded across both, and images/s together.

Per batch size and side: images/s, U-Net iterations/s, peak device memory and model FLOPs
utilisation (the U-Net's and VAE decoder's FLOPs, counted by torch's counter, against the
GPU's dense fp16 peak). Sides alternate call by call, after warm-up calls. Prints one JSON
object.

    python benchmarks/gpu.py                      # a GPU: 512 px, 50 steps, 1/4/8/16, fp16
    python benchmarks/gpu.py --small              # a CPU check: 64 px, 2 steps, 1/2, fp32
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prompt_cache import redis_server  # noqa: E402  (beside this script)
from sd15 import SD15_SCHEDULER, sd15_pipeline, sd15_safety_checker  # noqa: E402

from sdq.models.generate.specs import GenerationSpec  # noqa: E402
from sdq.models.registry import folder_content_hash  # noqa: E402
from sdq.models.store import LocalStore  # noqa: E402
from sdq.workers.generate.conditioning import PromptEmbeddings, family_encoder  # noqa: E402
from sdq.workers.generate.pipelines import (  # noqa: E402
    Loaded,
    PipelineCache,
    compile_pipeline,
    render,
    warm,
)
from sdq.workers.generate.shared_prompts import SharedPrompts  # noqa: E402
from sdq.workers.gpu import device_name, peak_flops, release_device_memory  # noqa: E402
from sdq.workers.weights import ModelFiles  # noqa: E402

NEGATIVE = "blurry, low quality"
SEEDS_PER_PROMPT = 4
# SDQ_COMPILE_BATCHES' default: calls are padded up to one of these.
BUCKETS = (1, 2, 4, 8, 16)

Call = Callable[[list[GenerationSpec]], object]


def specs(batch: int, call: int, args: argparse.Namespace, **model) -> list[GenerationSpec]:
    settings = {
        "model_name": "sd15-random", "model_source": "sd15-random", "model_revision": "bench",
        "scheduler": "EulerDiscreteScheduler", "scheduler_config": SD15_SCHEDULER,
        "negative_prompt": NEGATIVE, "steps": args.steps, "guidance": 7.5,
        "width": args.size, "height": args.size, "dtype": args.dtype, **model,
    }  # fmt: skip
    numbers = range(call * batch, (call + 1) * batch)
    return [
        GenerationSpec(prompt=f"subject {n // SEEDS_PER_PROMPT}, a style", seed=n, **settings)
        for n in numbers
    ]


def plain_call(pipeline, batch: list[GenerationSpec]) -> None:
    first = batch[0]
    pipeline(
        prompt=[spec.prompt for spec in batch],
        negative_prompt=[spec.negative_prompt for spec in batch],
        num_inference_steps=first.steps, guidance_scale=first.guidance,
        width=first.width, height=first.height,
        generator=[torch.Generator("cpu").manual_seed(spec.seed) for spec in batch],
        output_type="pil",
    )  # fmt: skip


def flops_per_image(pipeline, args: argparse.Namespace) -> float:
    """U-Net passes (two per step: guidance runs it on the prompt and the negative) and one
    VAE decode, as torch's FLOP counter counts them."""
    unet = pipeline.unet.config
    side = args.size // pipeline.vae_scale_factor
    device, dtype = pipeline.device, pipeline.unet.dtype
    latents = torch.zeros((2, unet.in_channels, side, side), device=device, dtype=dtype)
    text = torch.zeros((2, 77, unet.cross_attention_dim), device=device, dtype=dtype)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        pipeline.unet(latents, torch.tensor([500], device=device), text)
    flops = counter.get_total_flops()
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        pipeline.vae.decode(latents[:1])
    return flops * args.steps + counter.get_total_flops()


def measure(sides: dict[str, Call], batch: int, args, flops: float, **model) -> dict:
    """Warm-up calls of each side, then `--calls` rounds of one call each, in turn."""
    for run in sides.values():
        for call in range(args.warmup):
            run(specs(batch, call, args, **model))
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    peaks: dict[str, float | None] = {}
    for call in range(args.calls):
        for name, run in sides.items():
            batch_specs = specs(batch, args.warmup + call, args, **model)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            run(batch_specs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            seconds[name].append(time.perf_counter() - started)
    peak = peak_flops(torch.device(device_name()))
    result: dict = {"batch": batch}
    for name, times in seconds.items():
        per_call = statistics.median(times)
        images_per_second = batch / per_call
        result[name] = {
            "images_per_s": round(images_per_second, 3),
            "unet_it_per_s": round(args.steps / per_call, 2),
            "peak_memory_gb": round(peaks[name], 2) if name in peaks else None,
            "mfu": round(flops * images_per_second / peak, 4) if peak else None,
        }
    return result


def ratio(row: dict, side: str, baseline: str) -> float:
    return round(row[side]["images_per_s"] / row[baseline]["images_per_s"], 3)


def built(
    args: argparse.Namespace,
    make: Callable[[], object] = sd15_pipeline,
    *,
    channels_last: bool = False,
):
    """The pipeline built in code (SD 1.5's shape, or what `make` builds), on the device, as
    a worker lays it out there (SDQ_CHANNELS_LAST)."""
    pipeline = make().to(device_name(), getattr(torch, args.dtype))
    pipeline.set_progress_bar_config(disable=True)
    if torch.cuda.is_available() and channels_last:
        pipeline.unet.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    return pipeline


def kept_prompts(pipeline) -> PromptEmbeddings:
    """A fresh prompt cache per side of the table: each starts cold, as a worker does."""
    return PromptEmbeddings(family_encoder(pipeline), 1024)


def shipped_folder(root: Path) -> Path:
    """The pipeline saved as SD 1.5 ships: with its safety checker and feature extractor."""
    from transformers import CLIPImageProcessor

    pipeline = sd15_pipeline()
    features = CLIPImageProcessor(size={"shortest_edge": 224},
                                  crop_size={"height": 224, "width": 224})  # fmt: skip
    pipeline.register_modules(safety_checker=sd15_safety_checker(), feature_extractor=features)
    pipeline.register_to_config(requires_safety_checker=True)
    folder = root / "sd15-shipped"
    pipeline.to(torch.float16).save_pretrained(folder)
    return folder


def loading(args, folder: Path, cache: Path, flops: float) -> list[dict]:
    """The folder loaded as diffusers loads it (the checker in every call), and without
    its checker, against sdq's worker: checker off (the default), then on, run apart. All
    four loaded at once, their calls in turn."""
    from diffusers import StableDiffusionPipeline

    dtype = getattr(torch, args.dtype)
    model = {"model_source": str(folder), "model_revision": folder_content_hash(folder)}
    sides: dict[str, Call] = {}
    load_seconds: dict[str, float] = {}
    for name, options in (("plain_checker_as_shipped", {}),
                          ("plain_no_checker", {"safety_checker": None,
                                                "requires_safety_checker": False})):  # fmt: skip
        started = time.perf_counter()
        pipeline = StableDiffusionPipeline.from_pretrained(folder, dtype=dtype, **options)
        pipeline = pipeline.to(device_name())
        pipeline.set_progress_bar_config(disable=True)
        load_seconds[name] = time.perf_counter() - started
        sides[name] = lambda batch, p=pipeline: plain_call(p, batch)
    workers = PipelineCache(files=ModelFiles(LocalStore(cache / "store"), cache), size=1)
    first = specs(1, 0, args, **model)[0]
    started = time.perf_counter()
    loaded, _ = workers.get(first)
    load_seconds["sdq_checker_off"] = time.perf_counter() - started
    checker = workers.safety_checker(first)  # loaded the first time a spec asks for it
    load_seconds["sdq_safety_check"] = time.perf_counter() - started

    def checked(batch: list[GenerationSpec]) -> None:
        checker.flagged(render(loaded, [replace(spec, safety_check=True) for spec in batch]))

    sides |= {"sdq_checker_off": lambda batch: render(loaded, batch), "sdq_safety_check": checked}
    row = measure(sides, args.batch, args, flops, **model)
    rows = [{"side": name, "load_s": round(load_seconds[name], 2), **row[name]} for name in sides]
    workers.clear()
    return rows


def eager_sides(pipeline) -> dict[str, Call]:
    """The pipeline as built, called as a script calls it and by the worker's render()."""
    loaded = Loaded(pipeline, kept_prompts(pipeline))
    return {"plain": lambda batch: plain_call(pipeline, batch),
            "sdq": lambda batch: render(loaded, batch)}  # fmt: skip


def eager(args, flops: float) -> list[dict]:
    sides = eager_sides(built(args))
    rows = [measure(sides, batch, args, flops) for batch in args.batches]
    return [{**row, "sdq_vs_plain": ratio(row, "sdq", "plain")} for row in rows]


def compiled(args, flops: float) -> list[dict]:
    """Per compile mode, a fresh pipeline compiled and its buckets warmed at the shape;
    then each batch size (those between buckets padded by sdq)."""
    rows = []
    for mode in args.compile_modes:
        torch._dynamo.reset()
        rows += compiled_rows(args, mode, flops)
        release_device_memory()
    return rows


@dataclass
class Compiled:
    """A fresh pipeline compiled as SDQ_COMPILE compiles it, its buckets warmed at the
    shape (`warm_s`), and its two sides; each side's calls count the graphs compiled
    during them (recompilations, after the warm-up)."""

    sides: dict[str, Call]
    warm_s: float
    graphs_at_warm: int
    recompiled: dict[str, list[int]]


def compiled_sides(
    args, mode: str, buckets: tuple[int, ...] = BUCKETS, make: Callable[[], object] = sd15_pipeline
) -> Compiled:
    from torch._dynamo.utils import counters

    counters.clear()
    pipeline = built(args, make)
    compile_pipeline(pipeline, mode, backend=args.compile_backend)
    loaded = Loaded(pipeline, kept_prompts(pipeline), buckets)
    started = time.perf_counter()
    warm(loaded, specs(1, 0, args)[0], ((args.size, args.size),))
    warmed_in, graphs = time.perf_counter() - started, counters["stats"]["unique_graphs"]
    recompiled: dict[str, list[int]] = {"plain": [], "sdq": []}

    def counted(name: str, run: Call) -> Call:
        def call(batch: list[GenerationSpec]) -> None:
            before = counters["stats"]["unique_graphs"]
            run(batch)
            recompiled[name].append(counters["stats"]["unique_graphs"] - before)

        return call

    sides = {"plain": counted("plain", lambda batch: plain_call(pipeline, batch)),
             "sdq": counted("sdq", lambda batch: render(loaded, batch))}  # fmt: skip
    return Compiled(sides, warmed_in, graphs, recompiled)


def compiled_rows(args, mode: str, flops: float) -> list[dict]:
    done = compiled_sides(args, mode)
    rows = []
    for batch in args.compiled_batches:
        row = measure(done.sides, batch, args, flops)
        rows.append({"mode": mode, "cuda_graphs": "no-cudagraphs" not in mode,
                     "warm_s": round(done.warm_s, 1), "graphs_at_warm": done.graphs_at_warm,
                     **row, "sdq_vs_plain": ratio(row, "sdq", "plain")})  # fmt: skip
    rows[-1]["sdq_recompiles_after_warm"] = sum(done.recompiled["sdq"])
    return rows


def shared(args, folder: Path, cache: Path) -> dict:
    """Two worker processes rendering the same calls in opposite orders, with their own
    prompt caches and then with one shared in Redis."""
    calls = [specs(args.batch, call, args, model_source=str(folder),
                   model_revision=folder_content_hash(folder))
             for call in range(args.warmup + args.calls)]  # fmt: skip
    distinct = {text for call in calls for spec in call for text in (spec.prompt, NEGATIVE)}
    context = multiprocessing.get_context("spawn")
    result: dict = {"distinct_texts": len(distinct), "images": 2 * sum(map(len, calls))}
    with redis_server() as url:
        for name, shared_url in (("own_caches", None), ("shared_cache", url)):
            started = time.perf_counter()
            with context.Pool(2) as pool:
                work = [(calls, shared_url, cache), (calls[::-1], shared_url, cache)]
                encoded = sum(pool.starmap(worker_renders, work))
            seconds = time.perf_counter() - started
            result[name] = {"texts_encoded": encoded,
                            "images_per_s": round(result["images"] / seconds, 3)}  # fmt: skip
    return result


def worker_renders(calls: list[list[GenerationSpec]], url: str | None, cache: Path) -> int:
    """One worker process: loads the model as a worker does and renders every call."""
    shared_prompts = SharedPrompts(url, 10_000) if url else None
    files = ModelFiles(LocalStore(cache / "store"), cache)
    workers = PipelineCache(files=files, size=1, shared_prompts=shared_prompts)
    loaded, _ = workers.get(calls[0][0])
    for call in calls:
        render(loaded, call)
    return loaded.prompts.encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a CPU check: 64 px, 2 steps")
    parser.add_argument("--parts", default="loading,eager,compiled,shared")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--batch", type=int, default=4, help="of the loading and shared parts")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile-modes", default="max-autotune-no-cudagraphs,max-autotune")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="eager: traces and guards only (checks the part on a CPU)",
    )
    args = parser.parse_args()
    if args.small:
        args.size, args.steps, args.batch_sizes, args.dtype = 64, 2, "1,2", "float32"
        args.calls, args.warmup, args.batch, args.compile_backend = 2, 1, 2, "eager"
    args.batches = [int(size) for size in args.batch_sizes.split(",")]
    # Between buckets too: sdq pads a call of 3 to 4, 12 to 16; plain compiles each size.
    args.compiled_batches = sorted({*args.batches, *(b - 1 for b in args.batches if b > 2)})
    args.compile_modes = args.compile_modes.split(",")
    parts = args.parts.split(",")
    flops = flops_per_image(built(args), args)
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "size": args.size, "steps": args.steps, "dtype": args.dtype,
                    "gflops_per_image": round(flops / 1e9, 1)}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        folder = shipped_folder(root) if {"loading", "shared"} & set(parts) else root
        if "loading" in parts:
            result["loading"] = loading(args, folder, root / "cache", flops)
        if "eager" in parts:
            result["eager"] = eager(args, flops)
        if "compiled" in parts:
            result["compiled"] = compiled(args, flops)
        if "shared" in parts:
            result["shared"] = shared(args, folder, root / "cache")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
