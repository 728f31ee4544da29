"""Compiling a U-Net for training, cold and from the store, by region and whole; and a
generate worker's warm shapes, cold and from the store.

Each side is a process of its own with an empty inductor cache (a new machine's), training
the same U-Net on the same random batches for a few steps on the CPU (inductor's C++
backend) or a GPU (as a rank trains there: bf16 autocast, channels_last, TF32, cuDNN's
autotuner):
- eager: no compile, whose first step is what a compiled first step spends besides
  compiling;
- sdq cold: sdq's `--compile` (workers/train/loop/compiled.py): the repeated blocks
  compiled, the artifacts saved to a store folder after the first step;
- sdq warm: the same in a second process, which loads them before its first step;
- whole: the plain way, `torch.compile(unet)` of the whole model, cold.

`--kind generate`: a generate worker's pipeline cache (workers/generate/pipelines.py) loading
a saved model (the tiny one on a CPU, SD 1.5's shape in fp16 on a GPU) and warming its batch
buckets at one size: eager (not compiled), cold (SDQ_COMPILE's compile in `--compile-mode`,
reduce-overhead by default as in the device check, where a worker's default is
max-autotune; the artifacts saved to the store), warm (a second process, which loads them); no whole
side (a worker's U-Net is one graph already). Its first step is the model's load and warm-up;
its steps after it are renders at the smallest bucket, whose graphs made count as
recompilations.

A side's compile seconds are its first step's less eager's. JSON keys: `cold_seconds`,
`warm_seconds`, `second_over_first` (goal <= 0.25), `recompiles_after_warm` (graphs made
after the warm side's first step; goal 0), `whole_seconds` and `regional_over_whole` (goal
<= 0.5), and each side's steps per second after its first (`compiled_over_eager`,
`regional_over_whole`'s speed twin `regional_speed_over_whole`). Prints one JSON line per side
as it ends, then the summary.

    python benchmarks/compile_cache.py [--kind train|generate] [--steps 4]
        [--sides eager,cold,warm,whole]
        [--architecture tiny|sd2-narrow|sd2-base] [--batch-size 4]    # train
        [--compile-mode reduce-overhead]                              # generate

On a GPU: `--architecture sd2-base --batch-size 64 --steps 6` trains SD 2's full U-Net at its
config's sample size (64 latents: 512 px).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("eager", "cold", "warm", "whole")
# A generate worker's compiled batch buckets (SDQ_COMPILE_BATCHES), on a CPU and a GPU.
GENERATE_BATCHES = {False: (1, 2), True: (1, 8)}


def side(name: str, args: argparse.Namespace) -> dict:
    """One side's steps in this process: its first step's seconds, a later step's, and the
    graphs and kernels it compiled or found."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch._dynamo.utils import counters

    from benchmarks.unets import UNETS
    from sdq.models.store import LocalStore
    from sdq.models.train.specs import TrainOptions, TrainShardSpec
    from sdq.workers.train.loop.build import use_fast_kernels
    from sdq.workers.train.loop.compiled import SharedCompile, compile_regions

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    use_fast_kernels(device)  # TF32 and cuDNN's autotuner, as a rank on a GPU
    config = UNETS[args.architecture]
    unet = UNet2DConditionModel.from_config(config).to(device).train()
    if on_gpu:
        unet = unet.to(memory_format=torch.channels_last)
    model = unet
    if name in ("cold", "warm"):
        compile_regions(unet, buckets=False)
    elif name == "whole":
        model = torch.compile(unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, fused=on_gpu)
    size, batch = config["sample_size"], args.batch_size
    latents = torch.randn(batch, config["in_channels"], size, size, device=device)
    embeddings = torch.randn(batch, 77, config["cross_attention_dim"], device=device)
    spec = TrainShardSpec(run=0, first_step=0, last_step=args.steps, model_name="bench",
                          base_name=args.architecture, base_source="bench", base_revision="0",
                          prediction_type="epsilon", scheduler_config={},
                          options=TrainOptions(steps=args.steps, compile=True))  # fmt: skip
    shared = SharedCompile(LocalStore(Path(args.store)))
    inputs = SimpleNamespace(latents=latents, embeddings=embeddings)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu)
    seconds, graphs_after_first = [], 0
    for step in range(args.steps):
        started = time.perf_counter()
        first = shared.first_of_shape(spec, unet, inputs, saves=True, took=lambda *_: None) \
            if name in ("cold", "warm") else nullcontext()  # fmt: skip
        with first:
            timesteps = torch.randint(0, 1000, (batch,), device=device)
            with autocast:
                loss = model(latents, timesteps, embeddings).sample.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    return figures(name, seconds, graphs_after_first)


def figures(name: str, seconds: list[float], graphs_after_first: int) -> dict:
    """A side's line: its first step's seconds, a later step's, and the graphs and kernels
    this process compiled or found."""
    import torch
    from torch._dynamo.utils import counters

    on_gpu = torch.cuda.is_available()
    return {
        "side": name,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "first_step_s": round(seconds[0], 3),
        "step_s": round(statistics.median(seconds[1:]), 4),
        "graphs": counters["stats"]["unique_graphs"],
        "graphs_after_first_step": graphs_after_first,
        "kernels_compiled": counters["inductor"]["fxgraph_cache_miss"],
        "kernels_found": counters["inductor"]["fxgraph_cache_hit"],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
    }


def generate_side(name: str, args: argparse.Namespace) -> dict:
    """A generate worker's first job (loading and warming), then renders at batch 1."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.gpu import specs
    from sdq.models.registry import folder_content_hash
    from sdq.models.store import LocalStore
    from sdq.workers.generate.pipelines import PipelineCache, render
    from sdq.workers.weights import ModelFiles

    on_gpu = torch.cuda.is_available()
    folder = Path(args.store).parent / "model"
    # SD 1.5's 512 px at 50 steps on a GPU; the tiny model's 64 px at 4 on a CPU.
    shapes = SimpleNamespace(size=512 if on_gpu else 64, steps=50 if on_gpu else 4,
                             dtype="float16" if on_gpu else "float32")  # fmt: skip
    cache = Path(args.store).parent / f"files-{name}"
    pipelines = PipelineCache(
        files=ModelFiles(LocalStore(Path(args.store)), cache), size=1,
        compile_mode=None if name == "eager" else args.compile_mode,
        compile_batches=GENERATE_BATCHES[on_gpu], warm_shapes=((shapes.size, shapes.size),),
    )  # fmt: skip
    model = {"model_source": str(folder), "model_revision": folder_content_hash(folder)}
    calls = [specs(1, call, shapes, **model) for call in range(args.steps)]
    seconds = []
    for call in calls:
        started = time.perf_counter()
        loaded, _ = pipelines.get(call[0])
        if not seconds:
            graphs_at_warm = counters["stats"]["unique_graphs"]
        render(loaded, call)
        seconds.append(time.perf_counter() - started)
    return figures(name, seconds, graphs_at_warm)


def saved_model(folder: Path) -> None:
    """The model generate sides load, saved once: SD 1.5's shape in fp16 on a GPU."""
    import torch

    if torch.cuda.is_available():
        from benchmarks.sd15 import sd15_pipeline

        sd15_pipeline().to(torch.float16).save_pretrained(folder)
    else:
        from sdq.workers.tiny import build_pipeline

        build_pipeline().save_pretrained(folder)


def run_side(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    """A side in a fresh process with an inductor cache of its own."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"inductor-{name}")}
    done = subprocess.run(
        [sys.executable, __file__, "--side", name, "--kind", args.kind,
         "--architecture", args.architecture, "--steps", str(args.steps),
         "--batch-size", str(args.batch_size), "--compile-mode", args.compile_mode,
         "--store", str(scratch / "store")],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"side {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(sides: dict[str, dict], args: argparse.Namespace) -> dict:
    """The ratios of the sides that ran (a compile's seconds are its first step's less
    eager's; a speed is steps per second after the first)."""
    line: dict = {"kind": args.kind, "steps": args.steps, "device": sides["eager"]["device"]}
    if args.kind == "train":
        line |= {"architecture": args.architecture, "batch": args.batch_size}
    else:
        line |= {
            "compile_mode": args.compile_mode,
            "batches": GENERATE_BATCHES[line["device"] != "cpu"],
        }
    eager = sides["eager"]["first_step_s"]
    compile_s = {name: sides[name]["first_step_s"] - eager for name in sides if name != "eager"}
    line |= {f"{name}_seconds": round(seconds, 2) for name, seconds in compile_s.items()}
    if {"cold", "warm"} <= sides.keys():
        warm = sides["warm"]
        line |= {"second_over_first": round(compile_s["warm"] / compile_s["cold"], 3),
                 "recompiles_after_warm": warm["graphs"] - warm["graphs_after_first_step"],
                 "warm_kernels_compiled": warm["kernels_compiled"]}  # fmt: skip
    if {"cold", "whole"} <= sides.keys():
        line["regional_over_whole"] = round(compile_s["cold"] / compile_s["whole"], 3)
        line["regional_speed_over_whole"] = round(
            sides["whole"]["step_s"] / sides["cold"]["step_s"], 3
        )
    if "cold" in sides:
        line["compiled_over_eager"] = round(sides["eager"]["step_s"] / sides["cold"]["step_s"], 3)
    return line | {"step_s": {name: side["step_s"] for name, side in sides.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--architecture", default="tiny", choices=("tiny", "sd2-narrow", "sd2-base")
    )
    parser.add_argument("--kind", choices=("train", "generate"), default="train")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compile-mode", default="reduce-overhead", help="generate's SDQ_COMPILE")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="eager first, of " + ",".join(SIDES)
    )
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    asked = set(args.sides.split(","))
    if unknown := asked - set(SIDES):
        parser.error(f"unknown sides: {', '.join(sorted(unknown))}")
    if args.steps < 2:
        parser.error("--steps must be 2 or more: a step after the first is timed")
    if args.side:
        run = side if args.kind == "train" else generate_side
        print(json.dumps(run(args.side, args)))
        return
    # In SIDES' order whatever the order asked: cold saves what warm loads.
    names = ["eager", *(name for name in SIDES[1:] if name in asked)]
    if args.kind == "generate" and "whole" in names:
        names.remove("whole")
    sides = {}
    with tempfile.TemporaryDirectory(prefix="sdq-compile-") as scratch:
        if args.kind == "generate":
            saved_model(Path(scratch) / "model")
        for name in names:
            sides[name] = run_side(name, args, Path(scratch))
            print(json.dumps(sides[name]), flush=True)
    print(json.dumps(summary(sides, args)), flush=True)


if __name__ == "__main__":
    main()
