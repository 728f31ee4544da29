"""Compiling a U-Net for training, cold and from the store, by region and whole.

Each side is a process of its own with an empty inductor cache (a new machine's), training
the same U-Net on the same random batches for a few steps on the CPU (inductor's C++
backend) or a GPU:
- eager: no compile, whose first step is what a compiled first step spends besides
  compiling;
- sdq cold: sdq's `--compile` (workers/train/loop/compiled.py): the repeated blocks
  compiled, the artifacts saved to a store folder after the first step;
- sdq warm: the same in a second process, which loads them before its first step;
- whole: the plain way, `torch.compile(unet)` of the whole model, cold.

A side's compile seconds are its first step's less eager's. JSON keys: `cold_seconds`,
`warm_seconds`, `second_over_first` (goal <= 0.25), `recompiles_after_warm` (graphs made
after the warm side's first step; goal 0), `whole_seconds` and `regional_over_whole` (goal
<= 0.5). Prints one JSON line per side as it ends, then the summary.

    python benchmarks/compile_cache.py [--architecture tiny|sd2-narrow] [--steps 4]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("eager", "cold", "warm", "whole")


def side(name: str, architecture: str, steps: int, store_folder: str) -> dict:
    """One side's steps in this process: its first step's seconds, a later step's, and the
    graphs and kernels it compiled or found."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch._dynamo.utils import counters

    from benchmarks.unets import UNETS
    from sdq.models.store import LocalStore
    from sdq.models.train.specs import TrainOptions, TrainShardSpec
    from sdq.workers.train.loop.compiled import SharedCompile, compile_regions

    torch.manual_seed(0)
    config = UNETS[architecture]
    unet = UNet2DConditionModel.from_config(config).train()
    model = unet
    if name in ("cold", "warm"):
        compile_regions(unet)
    elif name == "whole":
        model = torch.compile(unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    size = config["sample_size"]
    latents = torch.randn(4, config["in_channels"], size, size)
    embeddings = torch.randn(4, 77, config["cross_attention_dim"])
    spec = TrainShardSpec(run=0, first_step=0, last_step=steps, model_name="bench",
                          base_name=architecture, base_source="bench", base_revision="0",
                          prediction_type="epsilon", scheduler_config={},
                          options=TrainOptions(steps=steps, compile=True))  # fmt: skip
    shared = SharedCompile(LocalStore(Path(store_folder)))
    inputs = SimpleNamespace(latents=latents, embeddings=embeddings)
    seconds, graphs_after_first = [], 0
    for step in range(steps):
        started = time.perf_counter()
        first = shared.first_step(spec, unet, inputs, saves=True) if name in ("cold", "warm") \
            else _nothing()  # fmt: skip
        with first:
            timesteps = torch.randint(0, 1000, (4,))
            loss = model(latents, timesteps, embeddings).sample.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    return {
        "side": name,
        "first_step_s": round(seconds[0], 3),
        "step_s": round(min(seconds[1:]), 4),
        "graphs": counters["stats"]["unique_graphs"],
        "graphs_after_first_step": graphs_after_first,
        "kernels_compiled": counters["inductor"]["fxgraph_cache_miss"],
        "kernels_found": counters["inductor"]["fxgraph_cache_hit"],
    }


def _nothing():
    from contextlib import nullcontext

    return nullcontext()


def run_side(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    """A side in a fresh process with an inductor cache of its own."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"inductor-{name}")}
    done = subprocess.run(
        [sys.executable, __file__, "--side", name, "--architecture", args.architecture,
         "--steps", str(args.steps), "--store", str(scratch / "store")],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"side {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(sides: dict[str, dict], args: argparse.Namespace) -> dict:
    eager = sides["eager"]["first_step_s"]
    cold, warm, whole = (sides[name]["first_step_s"] - eager for name in ("cold", "warm", "whole"))
    return {
        "architecture": args.architecture,
        "steps": args.steps,
        "cold_seconds": round(cold, 2),
        "warm_seconds": round(warm, 2),
        "second_over_first": round(warm / cold, 3),
        "recompiles_after_warm": sides["warm"]["graphs"] - sides["warm"]["graphs_after_first_step"],
        "whole_seconds": round(whole, 2),
        "regional_over_whole": round(cold / whole, 3),
        "warm_kernels_compiled": sides["warm"]["kernels_compiled"],
        "step_s": {name: sides[name]["step_s"] for name in SIDES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="tiny", choices=("tiny", "sd2-narrow"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.architecture, args.steps, args.store)))
        return
    sides = {}
    with tempfile.TemporaryDirectory(prefix="sdq-compile-") as scratch:
        for name in SIDES:
            sides[name] = run_side(name, args, Path(scratch))
            print(json.dumps(sides[name]), flush=True)
    print(json.dumps(summary(sides, args)))


if __name__ == "__main__":
    main()
