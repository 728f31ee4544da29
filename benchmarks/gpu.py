"""Generation as fast as the device allows: sdq's render against a plain diffusers loop.

A Stable Diffusion 1.5-shaped pipeline with random weights, built in code (benchmarks/sd15.py:
the 860M U-Net, the VAE, CLIP ViT-L/14's text tower), at --size with --steps, for each
batch size, in --dtype, first as loaded and then compiled (SDQ_COMPILE's recipe):
  plain: `pipeline(prompt=[...], negative_prompt=[...], generator=[...])`, as a script does;
  sdq:   the worker's render() on the same pipeline: a scheduler from the spec per call,
         per-image generators, prompt embeddings kept across calls (the prompts repeat,
         four seeds each, as a subject x style grid with --n 4 does).
Per batch size and side: images/s, U-Net iterations/s, peak device memory and model
FLOPs utilisation (the U-Net's and VAE decoder's FLOPs, counted by torch's counter, against
the GPU's dense fp16 peak), and sdq_vs_plain. Sides alternate call by call, after warm-up
calls (and compiling) of each shape. Prints one JSON object.

    python benchmarks/gpu.py                      # a GPU: 512 px, 50 steps, 1/4/8/16, fp16
    python benchmarks/gpu.py --small              # a CPU check: 64 px, 2 steps, 1/2, fp32
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sd15 import SD15_SCHEDULER, sd15_pipeline  # noqa: E402  (beside this script)

from sdq.models.generate.specs import GenerationSpec  # noqa: E402
from sdq.workers.generate.conditioning import PromptEmbeddings, family_encoder  # noqa: E402
from sdq.workers.generate.pipelines import Loaded, compile_pipeline, render  # noqa: E402
from sdq.workers.gpu import device_name, peak_flops  # noqa: E402

NEGATIVE = "blurry, low quality"
SEEDS_PER_PROMPT = 4


def specs(batch: int, call: int, args: argparse.Namespace) -> list[GenerationSpec]:
    settings = {
        "model_name": "sd15-random", "model_source": "sd15-random", "model_revision": "bench",
        "scheduler": "EulerDiscreteScheduler", "scheduler_config": SD15_SCHEDULER,
        "negative_prompt": NEGATIVE, "steps": args.steps, "guidance": 7.5,
        "width": args.size, "height": args.size, "dtype": args.dtype,
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
    side = args.size // 8
    device, dtype = pipeline.device, pipeline.unet.dtype
    latents = torch.zeros((2, 4, side, side), device=device, dtype=dtype)
    text = torch.zeros((2, 77, 768), device=device, dtype=dtype)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        pipeline.unet(latents, torch.tensor([500], device=device), text)
    unet = counter.get_total_flops()
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        pipeline.vae.decode(latents[:1])
    return unet * args.steps + counter.get_total_flops()


def measure(pipeline, loaded: Loaded, batch: int, args, flops: float) -> dict:
    """Warm-up calls of each side, then `--calls` rounds of one call each, in turn."""
    sides = {"plain": lambda specs: plain_call(pipeline, specs),
             "sdq": lambda specs: render(loaded, specs)}  # fmt: skip
    for run in sides.values():
        for call in range(args.warmup):
            run(specs(batch, call, args))
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    peaks: dict[str, float | None] = {}
    for call in range(args.calls):
        for name, run in sides.items():
            batch_specs = specs(batch, args.warmup + call, args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            run(batch_specs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            seconds[name].append(time.perf_counter() - started)
    peak = peak_flops(pipeline.device)
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
    result["sdq_vs_plain"] = round(
        result["sdq"]["images_per_s"] / result["plain"]["images_per_s"], 3
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a CPU check: 64 px, 2 steps")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--compile-mode",
        default="max-autotune-no-cudagraphs",
        help="torch.compile's mode of the compiled rows; none: no such rows",
    )
    args = parser.parse_args()
    if args.small:
        args.size, args.steps, args.batch_sizes, args.dtype = 64, 2, "1,2", "float32"
        args.calls, args.warmup, args.compile_mode = 2, 1, "none"
    pipeline = sd15_pipeline().to(device_name(), getattr(torch, args.dtype))
    pipeline.set_progress_bar_config(disable=True)
    if torch.cuda.is_available():
        pipeline.unet.to(memory_format=torch.channels_last)
        pipeline.vae.to(memory_format=torch.channels_last)
    flops = flops_per_image(pipeline, args)
    batches = [int(size) for size in args.batch_sizes.split(",")]
    rows = []
    for compiled in [False] + ([True] if args.compile_mode != "none" else []):
        if compiled:
            compile_pipeline(pipeline, args.compile_mode)
        # A fresh prompt cache per side of the table: each starts cold, as a worker does.
        loaded = Loaded(pipeline, PromptEmbeddings(family_encoder(pipeline), 1024))
        rows += [{"compiled": compiled, **measure(pipeline, loaded, batch, args, flops)}
                 for batch in batches]  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({
        "device": device, "size": args.size, "steps": args.steps, "dtype": args.dtype,
        "gflops_per_image": round(flops / 1e9, 1), "rows": rows,
        "sdq_vs_plain": statistics.median(row["sdq_vs_plain"] for row in rows),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
