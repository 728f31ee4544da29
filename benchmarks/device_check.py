"""One device check: sdq against the plain way on whatever GPU this machine has, within a
time budget, each result printed the moment it is measured.

Parts (`--parts`, all four by default), each with sdq's side and the plain side, which is
written as users write it (diffusers, transformers and torch; nothing of sdq's):
  train:    SD 2's full U-Net (866M parameters, random weights) at 256 px, batch 64, bf16:
            a rank's `Training` over latent shards on local disk against diffusers' loop
            under torchrun (benchmarks/train_gpu.py, benchmarks/plain_ddp.py); eager, then
            both torch.compiled, each side's compile time (its first step) apart.
  generate: SD 1.5's shape at 512 px, 50 steps, batches 1 and 8, fp16: the worker's render()
            against the pipeline called as a script calls it (benchmarks/gpu.py); eager (and
            the worker with SDQ_CHANNELS_LAST=1 beside it: channels_last_over_contiguous), then
            compiled as SDQ_COMPILE compiles (`--compile-mode`; reduce-overhead and
            max-autotune replay CUDA graphs), the buckets' warm-up apart, and the graphs
            compiled after it counted (recompilations).
  encode:   SD 1.5's VAE and text encoder over 256 px JPEGs, batch 32: the worker's batches
            (decoded on threads, ahead of the device) against a batched loop
            (benchmarks/plain_encode.py); and (measure "resolutions") the worker's one pass
            at 256 and 512 px over 512 px JPEGs against a pass at each: `one_pass_over_two`,
            what decoding each image once saves (benchmarks/encode.py --resolutions 256,512
            measures the same through the services).
  curate:   CLIP ViT-L/14's shape and an aesthetic head over the same JPEGs, batch 64: the
            worker's scoring against a batched CLIP script (benchmarks/plain_curate.py).

Each finished measurement is one JSON line: images or samples per second of each side,
`sdq_vs_plain`, peak device memory, MFU where FLOPs are counted (torch's counter against
the GPU's dense bf16/fp16 peak), and the seconds it took; training's sdq side has a line of
its own first (`"side": "sdq"`), out before its plain side starts. The first line names the
device, torch and the budget; the last sums up. Eager measurements of every part come first
and the compiled ones last (they cost the most). Before each, the check estimates its time from
what it has seen (a prior per measurement, scaled by how the ones done so far compared
with theirs; a compiled one from its eager one), and skips one that would not fit the
budget left, with a line saying so. Whatever runs at the budget's end (a compile slower
than its estimate) is stopped there, with a line saying so, and the check ends.

    python benchmarks/device_check.py [--budget-s 480] [--parts train,generate,encode,curate]
        [--measures eager,compiled,resolutions] [--compile-mode reduce-overhead]
    python benchmarks/device_check.py --small     # a CPU check: tiny shapes, a few steps

On a bare GPU machine with torch, see docs/performance.md for the packages to carry there.
"""

import time

STARTED = time.monotonic()  # the budget counts from here: the imports are in it

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import contextmanager, suppress  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

PARTS = ("train", "generate", "encode", "curate")
# resolutions: encode's one pass at two resolutions against a pass at each.
MEASURES = ("eager", "compiled", "resolutions")
OCTETS = "application/octet-stream"
# What runs, in order: every part's eager measurement, encode's two resolutions, then the
# compiled ones (they cost the most).
SCHEDULE = (
    ("train", "eager"),
    ("generate", "eager"),
    ("encode", "eager"),
    ("curate", "eager"),
    ("encode", "resolutions"),
    ("generate", "compiled"),
    ("train", "compiled"),
)
# Seconds each step takes on the reference machines, setup included, what the first
# estimates go by: an H100 (guessed from the parts' earlier runs: the compiles are the least
# sure) and, for --small, a 2-core CPU. "generate compile" is the compiles of both sides at
# both batch sizes (sdq's warm-up, the plain side's first calls); "train compile" is sdq's
# first compiled step (by region: 28 s on an H200), "train whole compile" the plain side's
# (the whole U-Net: 141 s there).
PRIORS = {
    "gpu": {"imports": 25, "train eager": 65, "generate eager": 45, "encode eager": 25,
            "curate eager": 25, "encode resolutions": 40, "generate compile": 190,
            "train compile": 30, "train whole compile": 140},
    "small": {"imports": 10, "train eager": 30, "generate eager": 10, "encode eager": 3,
              "curate eager": 4, "encode resolutions": 6, "generate compile": 15,
              "train compile": 8, "train whole compile": 8},
}  # fmt: skip
# The modules each part needs beyond torch (beside this script, or sdq's).
MODULES = {
    "train": ("train_gpu", "unets"),
    "generate": ("gpu", "sdq.workers.tiny"),
    "encode": ("plain_encode", "sd15", "sdq.workers.encode.encoders", "sdq.workers.encode.work"),
    "curate": ("clips", "plain_curate", "sdq.workers.curate.scoring", "sdq.workers.curate.work"),
}


class Check:
    """The budget, the lines printed, and what the check has seen."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Kept back from the budget: the summary, stopping what runs, the process's exit.
        self.margin = max(2.0, 0.03 * args.budget_s)
        self.deadline = STARTED + args.budget_s - self.margin
        self.priors = PRIORS["small" if args.small else "gpu"]
        self.lock = threading.Lock()
        self.running: dict = {"step": "setup"}  # what runs now: its part and measure
        self.imported = False
        self.seen: dict[str, dict] = {}  # "part measure": its line
        self.paces: list[float] = []  # seconds taken over the prior, of the eager steps
        self.done: list[str] = []
        self.skipped: list[str] = []
        self.failed: list[str] = []
        self.scratch = Path(tempfile.mkdtemp(prefix="sdq-device-check-"))
        self.cache: dict = {}

    def elapsed(self) -> float:
        return time.monotonic() - STARTED

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def emit(self, line: dict) -> None:
        with self.lock:
            print(json.dumps(line), flush=True)

    def pace(self) -> float:
        """How this machine compares with the reference, by the steps done so far."""
        return min(3.0, max(0.5, statistics.median(self.paces))) if self.paces else 1.0

    def estimate(self, part: str, measure: str) -> float:
        pace = self.pace()
        eager = self.seen.get(f"{part} eager", {}).get("seconds")
        if eager is None:
            eager = self.priors[f"{part} eager"] * pace
        if measure in ("eager", "resolutions"):
            seconds = self.priors[f"{part} {measure}"] * pace
        elif part == "generate":  # a compiled pipeline's warm-up, then calls as eager
            seconds = self.priors["generate compile"] * pace + eager
        else:  # each side compiles (sdq by region, the plain side whole), then trains as eager
            compiles = self.priors["train compile"] + self.priors["train whole compile"]
            seconds = compiles * pace + eager
        return seconds + (0 if self.imported else self.priors["imports"])

    def fits(self, seconds: float, **where) -> bool:
        """Whether a step estimated at `seconds` fits the budget left; if not, says so."""
        left = self.left()
        if seconds <= left:
            return True
        name = " ".join(str(value) for value in where.values())
        self.skipped.append(name)
        self.emit({**where, "skipped": f"would take ~{seconds:.0f} s, {max(0, left):.0f} s left"})
        return False

    def finish(self, line: dict, started: float, *, emit: bool = True) -> None:
        """A step done: its line printed (with the seconds it took) and kept, and its pace
        against its prior noted."""
        seconds = time.monotonic() - started
        line["seconds"] = round(seconds, 1)
        if emit:
            self.emit(line)
        name = f"{line['part']} {line['measure']}"
        self.seen[name] = line
        self.done.append(name)
        if line["measure"] == "eager":
            self.paces.append(seconds / self.priors[name])

    def cached(self, key, make: Callable):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def summary(self) -> dict:
        return {"summary": True, "seconds": round(self.elapsed(), 1),
                "budget_s": self.args.budget_s, "measured": self.done,
                "skipped": self.skipped, "failed": self.failed}  # fmt: skip

    def watch(self) -> None:
        """Ends the check at the budget, whatever runs then."""
        self.timer = threading.Timer(max(0.0, self.left()), self.stop)
        self.timer.daemon = True
        self.timer.start()

    def end(self) -> None:
        with self.lock:
            self.timer.cancel()
            print(json.dumps(self.summary()), flush=True)
        shutil.rmtree(self.scratch, ignore_errors=True)

    def stop(self) -> None:
        with self.lock:
            reason = f"still running at the budget's end, {self.elapsed():.0f} s in"
            print(json.dumps({**self.running, "stopped": reason}), flush=True)
            self.failed.append(" ".join(self.running.values()))
            end_children()
            shutil.rmtree(self.scratch, ignore_errors=True)
            print(json.dumps(self.summary()), flush=True)
            os._exit(0)


def end_children() -> None:
    """This process's own children (the plain training's torchrun, compile workers)."""
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):
            child.kill()


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def free() -> None:
    """What the last step let go of, handed back to the device (compiled graphs, and the
    CUDA graphs' memory pools they hold, too)."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 3) if theirs else None


def mfu(flops_per_sample: float | None, per_second: float) -> float | None:
    import torch

    from sdq.workers.gpu import peak_flops

    peak = peak_flops(torch.device("cuda")) if cuda() else None
    if not peak or not flops_per_sample:
        return None
    return round(flops_per_sample * per_second / peak, 4)


@contextmanager
def compiled_with(backend: str | None):
    """torch.compile with `backend` while sdq's training state is built and first run (its
    build compiles with torch's default, inductor; --small traces and guards only, as
    SDQ_COMPILE_BACKEND=eager does for generation)."""
    import torch

    if backend in (None, "inductor"):
        yield
        return
    original = torch.compile
    torch.compile = partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


# --- train -------------------------------------------------------------------------------


def train(check: Check, compiled: bool) -> None:
    """sdq's rank, then the plain loop in its own torchrun process (one at a time: at SD 2's
    full size, with AdamW and the EMA, both would not fit beside each other)."""
    from torch._dynamo.utils import counters
    from train_gpu import PlainLoop, SdqRank, peak_memory_gb, write_shards
    from unets import UNETS

    from sdq.models.store import LocalStore

    started = time.monotonic()
    small = check.args.small
    args = argparse.Namespace(
        architecture="tiny" if small else "sd2-base", resolution=64 if small else 256,
        batch_size=8 if small else 64, warmup=2 if small else 10, steps=4 if small else 40,
        rounds=1, checkpoints=0, shards=1 if small else 2, rows=32 if small else 640,
        compile=compiled,
    )  # fmt: skip
    backend = ("eager" if small else "inductor") if compiled else None
    config = UNETS[args.architecture]
    store = LocalStore(check.scratch / "train")
    inputs = check.cached("train shards", lambda: write_shards(store, config, args))
    measure = "compiled" if compiled else "eager"
    line: dict = {"part": "train", "measure": measure, "unet": args.architecture,
                  "resolution": args.resolution, "batch": args.batch_size,
                  "dtype": "bfloat16" if cuda() else "float32",
                  "timed_steps": args.steps}  # fmt: skip
    if cuda():
        import torch

        torch.cuda.reset_peak_memory_stats()
    with compiled_with(backend):
        sdq = SdqRank(store, inputs, config, args)
        graphs = counters["stats"]["unique_graphs"]
        timed = sdq.timed(args.steps)
    recompiled = counters["stats"]["unique_graphs"] - graphs
    flops = sdq.training.state.flops_per_sample
    speed = timed["samples_per_second"]
    line |= {"sdq_samples_per_s": round(speed, 2), "sdq_mfu": mfu(flops, speed),
             "sdq_peak_memory_gib": peak_memory_gb(),
             "sdq_data_wait_share": round(timed["data_wait_share"], 4)}  # fmt: skip
    if compiled:
        line |= {"sdq_compile_s": round(sdq.first_step_s, 1),
                 "sdq_recompiles_after_warm": recompiled}  # fmt: skip
    sdq_seconds = time.monotonic() - started
    # sdq's side on its own line now: a plain side cut off by the budget loses nothing of it.
    check.emit(line | {"side": "sdq", "seconds": round(sdq_seconds, 1)})
    sdq.training.close()
    del sdq
    free()
    # The plain side trains as sdq's did (its eager line, else sdq's seconds less its own
    # compile), and compiled, compiles the whole U-Net first.
    trains = sdq_seconds - line.get("sdq_compile_s", 0.0)
    plain_estimate = check.seen.get("train eager", {}).get("plain_seconds", trains)
    if compiled:
        plain_estimate += check.priors["train whole compile"] * check.pace()
    if plain_estimate > check.left():
        line["plain_skipped"] = f"would take ~{plain_estimate:.0f} s, {check.left():.0f} s left"
    else:
        plain_started = time.monotonic()
        plain = PlainLoop(check.scratch / "train", config, args, compile_backend=backend).run()
        speed = plain["samples_per_second"]
        line |= {"plain_samples_per_s": round(speed, 2), "plain_mfu": mfu(flops, speed),
                 "plain_peak_memory_gib": gib(plain.get("peak_memory_gb")),
                 "sdq_vs_plain": ratio(line["sdq_samples_per_s"], speed),
                 "plain_seconds": round(time.monotonic() - plain_started, 1)}  # fmt: skip
        if compiled:
            line |= {"plain_compile_s": round(plain["first_step_s"], 1),
                     "plain_recompiles_after_warm": plain.get("recompiles_after_warm")}  # fmt: skip
    check.finish(line, started)


# --- generate ----------------------------------------------------------------------------


def generate(check: Check, compiled: bool) -> None:
    """Batch 1 then 8 (1 and 2 with --small), sides in turn call by call (gpu.measure)."""
    import gpu

    from sdq.workers.tiny import build_pipeline

    started = time.monotonic()
    small = check.args.small
    args = argparse.Namespace(
        size=64 if small else 512, steps=2 if small else 50,
        dtype="float32" if small else "float16", warmup=1, calls=1 if small else 2,
        compile_backend="eager" if small else "inductor",
    )  # fmt: skip
    batches = (1, 2) if small else (1, 8)
    make = build_pipeline if small else gpu.sd15_pipeline
    model = "tiny" if small else "sd15-shape"
    measure = "compiled" if compiled else "eager"
    about = {"model": model, "size": args.size, "steps": args.steps, "dtype": args.dtype}
    if compiled:
        import torch

        torch._dynamo.reset()
        flops = check.seen.get("generate eager", {}).get("flops")
        mode = check.args.compile_mode
        done = gpu.compiled_sides(args, mode, buckets=batches, make=make)
        sides = done.sides
        check.emit({"part": "generate", "measure": "compiled warm-up", **about, "mode": mode,
                    "backend": args.compile_backend, "batches": list(batches),
                    "warm_s": round(done.warm_s, 1), "graphs_at_warm": done.graphs_at_warm,
                    "seconds": round(time.monotonic() - started, 1)})  # fmt: skip
    else:
        pipeline = gpu.built(args, make)
        flops = gpu.flops_per_image(pipeline, args)
        sides = gpu.eager_sides(pipeline)
        # The worker with SDQ_CHANNELS_LAST=1, measured in the same turns.
        channels_last = gpu.eager_sides(gpu.built(args, make, channels_last=True))
        sides["sdq_channels_last"] = channels_last["sdq"]
    eager = check.seen.get("generate eager", {}).get("calls_s", {})
    calls_s: dict[int, float] = {}  # each batch size's calls (the compiles left out)
    plain_warm_s = 0.0
    for batch in batches:
        if calls_s:
            # Its calls as eager's were, or as the last size's grown by 0.2 of the images
            # added (a call's time grows by less than its batch: 1 to 8 is ~1.7x on an
            # H100); compiled, the plain side's compile as at the last size.
            size, seconds = list(calls_s.items())[-1]
            estimate = eager.get(batch, seconds * (1 + 0.2 * (batch / size - 1)))
            estimate += plain_warm_s
            if not check.fits(estimate, part="generate", measure=measure, batch=batch):
                continue
        measured = time.monotonic()
        line = {"part": "generate", "measure": measure, "batch": batch, **about}
        if compiled:
            # The plain script's first call at this size compiles its own graphs (its
            # tensors are not inference tensors as sdq's are: the graphs sdq warmed do not
            # serve it); timed apart, as sdq's warm-up is.
            sides["plain"](gpu.specs(batch, 0, args))
            plain_warm_s = time.monotonic() - measured
            line["plain_warm_s"] = round(plain_warm_s, 1)
            counts = {name: len(done.recompiled[name]) for name in sides}
        called = time.monotonic()
        row = gpu.measure(sides, batch, args, flops)
        calls_s[batch] = time.monotonic() - called
        for name in ("sdq", "plain"):
            line |= {f"{name}_images_per_s": row[name]["images_per_s"],
                     f"{name}_unet_it_per_s": row[name]["unet_it_per_s"],
                     f"{name}_peak_memory_gib": row[name]["peak_memory_gb"],
                     f"{name}_mfu": row[name]["mfu"]}  # fmt: skip
            if compiled:
                line[f"{name}_recompiles_after_warm"] = sum(done.recompiled[name][counts[name] :])
        if "sdq_channels_last" in row:
            line["sdq_channels_last_images_per_s"] = row["sdq_channels_last"]["images_per_s"]
            line["channels_last_over_contiguous"] = gpu.ratio(row, "sdq_channels_last", "sdq")
        seconds = time.monotonic() - measured
        line |= {"sdq_vs_plain": gpu.ratio(row, "sdq", "plain"), "seconds": round(seconds, 1)}
        check.emit(line)
    kept = {"part": "generate", "measure": measure, "flops": flops, "calls_s": calls_s}
    check.finish(kept, started, emit=False)


# --- encode and curate ---------------------------------------------------------------------


def jpegs(numbers: range, side: int) -> list[bytes]:
    """Photo-like JPEGs (gradients and noise) at `side` px, as a download stores them."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side]
    base = np.stack([x * 255 / side, y * 255 / side, (x * y) % 255], -1)
    images = []
    for n in numbers:
        pixels = np.roll(base, n, axis=1) + np.random.default_rng(n).normal(0, 10, base.shape)
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def image_shard(check: Check, count: int, side: int):
    from sdq.workers.shards.images import ImageShard

    images = check.cached(("jpegs", side), list)
    images += jpegs(range(len(images), count), side)
    images = images[:count]
    return ImageShard(keys=[f"{n:06d}" for n in range(count)], urls=[""] * count,
                      captions=[f"subject {n % 16}, a style" for n in range(count)],
                      sha256s=[""] * count, images=images,
                      found_sizes=[(side, side)] * count)  # fmt: skip


def weight_bytes(*modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def counted_flops(run: Callable[[], object]) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        run()
    return counter.get_total_flops()


def in_turn(sides: dict[str, Callable], shard, rounds: int, weights: dict[str, int]) -> dict:
    """A warm-up pass of each side over the shard's first batches, then `rounds` passes of
    each over the whole shard, in turn: each side's median samples/s and its peak memory
    (both sides' models stay loaded: the other's weights are taken off)."""
    import torch

    for run in sides.values():
        run(shard.only(shard.keys[: min(len(shard), 64)]))
    speeds: dict[str, list[float]] = {name: [] for name in sides}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in sides.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            passed = time.perf_counter()
            run(shard)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                others = sum(size for side, size in weights.items() if side != name)
                peak = (torch.cuda.max_memory_allocated() - others) / 2**30
                peaks[name] = max(peaks.get(name, 0.0), peak)
            speeds[name].append(len(shard) / (time.perf_counter() - passed))
    return {name: (statistics.median(values), peaks.get(name)) for name, values in speeds.items()}


def sized(check: Check, part: str) -> dict:
    small = check.args.small
    return {
        "images": 16 if small else {"encode": 512, "curate": 1024}[part],
        "resolution": 64 if small else 256,
        "batch": 8 if small else {"encode": 32, "curate": 64}[part],
        "dtype": "float16" if cuda() else "float32",
        "rounds": 1 if small else 2,
    }


def encoders_at(check: Check, size: dict, resolutions: list[int]):
    """SD 1.5's VAE and text encoder (random weights; tiny ones for --small) saved once as a
    pipeline's folder, as sdq and a script both load them; loaded by the worker's loader,
    with a spec for each resolution."""
    from dataclasses import replace

    import torch
    from diffusers import AutoencoderKL
    from sd15 import sd15_text_encoder

    from sdq.models.encode.specs import EncodeSpec
    from sdq.models.store import LocalStore
    from sdq.models.train.architectures import SD15_VAE
    from sdq.workers.encode.encoders import LoadedEncoders
    from sdq.workers.tiny import build_text_encoder, build_tokenizer, build_vae
    from sdq.workers.weights import ModelFiles

    def saved():
        folder, dtype = check.scratch / "encoders", getattr(torch, size["dtype"])
        torch.manual_seed(0)
        vae = build_vae() if check.args.small else AutoencoderKL(**SD15_VAE)
        vae.to(dtype).save_pretrained(folder / "vae")
        text_encoder = build_text_encoder() if check.args.small else sd15_text_encoder()
        text_encoder.to(dtype).save_pretrained(folder / "text_encoder")
        build_tokenizer().save_pretrained(folder / "tokenizer")
        index = {"_class_name": "StableDiffusionPipeline",
                 "vae": ["diffusers", "AutoencoderKL"],
                 "text_encoder": ["transformers", "CLIPTextModel"],
                 "tokenizer": ["transformers", "CLIPTokenizer"]}  # fmt: skip
        (folder / "model_index.json").write_text(json.dumps(index))
        return folder

    folder = check.cached("encoders", saved)
    spec = EncodeSpec(
        dataset="device-check", shard=0, shard_sha256="", image_format="jpg",
        model_name="sd15-shape", model_source=str(folder), model_revision="device-check",
        resolution=resolutions[0], dtype=size["dtype"],
    )  # fmt: skip
    specs = [replace(spec, resolution=resolution) for resolution in resolutions]
    files = ModelFiles(LocalStore(check.scratch / "store"), check.scratch / "cache")
    return folder, LoadedEncoders(files).get(specs[0]), specs


def worker_encode(encoders, specs: list, batch: int) -> Callable:
    """The worker's encode of a shard at each of `specs`' resolutions in one pass, each image
    decoded and each caption encoded once for all (workers/encode/work.py), short of the
    store."""
    from concurrent.futures import ThreadPoolExecutor

    from sdq.workers.ahead import ahead_of_device
    from sdq.workers.encode.batches import prepare_batches
    from sdq.workers.encode.encoders import encode_batch, join
    from sdq.workers.encode.work import BATCHES_AHEAD, DECODE_THREADS
    from sdq.workers.shards.latents import latent_shard_bytes

    def run(shard) -> None:
        with ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="sdq-decode") as decoders:
            batches = prepare_batches(shard, specs, encoders.tokenizers, batch_size=batch,
                                      decoders=decoders, conditioned=False,
                                      pin=encoders.pins)  # fmt: skip
            made: dict = {}
            for each in ahead_of_device(batches, BATCHES_AHEAD, encoders.device):
                for key, encoded in encode_batch(encoders, each).items():
                    made.setdefault(key, []).append(encoded)
            for (_, shape), parts in made.items():
                latent_shard_bytes(shard.lineage(), join(encoders, parts, shape),
                                   {"dataset": "device-check"})  # fmt: skip

    return run


def encode(check: Check, compiled: bool = False) -> None:
    import numpy as np
    import torch
    from plain_encode import PlainEncoder, save

    started = time.monotonic()
    small, size = check.args.small, sized(check, "encode")
    dtype = getattr(torch, size["dtype"])
    side, batch = size["resolution"], size["batch"]
    folder, encoders, specs = encoders_at(check, size, [side])
    plain = PlainEncoder.from_pretrained(folder, encoders.device, dtype)

    def plain_loop(shard) -> None:
        latents, embeddings = [], []
        for start in range(0, len(shard), batch):
            stop = start + batch
            latent, embedding = plain.encode(shard.images[start:stop], shard.captions[start:stop],
                                             list(range(start, min(stop, len(shard)))))  # fmt: skip
            latents.append(latent)
            embeddings.append(embedding)
        save(check.scratch / "plain-latents.parquet", shard.keys, np.concatenate(latents),
             np.concatenate(embeddings))  # fmt: skip

    flops = counted_flops(lambda: (
        encoders.vae.encode(torch.zeros(1, 3, side, side, device=encoders.device, dtype=dtype)),
        encoders.text_encoder(torch.zeros(1, 77, dtype=torch.long, device=encoders.device)),
    ))  # fmt: skip
    weights = {"sdq": weight_bytes(encoders.vae, encoders.text_encoder),
               "plain": weight_bytes(plain.vae, plain.text_encoder)}  # fmt: skip
    shard = image_shard(check, size["images"], side)
    sides = {"sdq": worker_encode(encoders, specs, batch), "plain": plain_loop}
    results = in_turn(sides, shard, size["rounds"], weights)
    line = {"part": "encode", "measure": "eager", "model": "tiny" if small else "sd15-shape"}
    line |= {name: size[name] for name in ("images", "resolution", "batch", "dtype")}
    check.finish(line | sides_line(results, flops, "samples"), started)


def encode_resolutions(check: Check, compiled: bool = False) -> None:
    """`sdq encode --resolutions R,2R` in one pass against a pass at each, over the same
    JPEGs at 2R (as downloaded at the largest): what decoding each image once saves, as
    benchmarks/encode.py measures it through the services (`one_pass_over_two`)."""
    started = time.monotonic()
    small, size = check.args.small, sized(check, "encode")
    low, high = size["resolution"], 2 * size["resolution"]
    _, encoders, (at_low, at_high) = encoders_at(check, size, [low, high])
    one_pass = worker_encode(encoders, [at_low, at_high], size["batch"])
    at_each = [worker_encode(encoders, [spec], size["batch"]) for spec in (at_low, at_high)]

    def a_pass_each(shard) -> None:
        for run in at_each:
            run(shard)

    shard = image_shard(check, size["images"], high)
    sides = {"one_pass": one_pass, "a_pass_each": a_pass_each}
    results = in_turn(sides, shard, size["rounds"], dict.fromkeys(sides, 0))
    line = {"part": "encode", "measure": "resolutions", "model": "tiny" if small else "sd15-shape",
            "resolutions": f"{low},{high}"}  # fmt: skip
    line |= {name: size[name] for name in ("images", "batch", "dtype")}
    for name, (speed, peak) in results.items():
        line |= {f"{name}_images_per_s": round(speed, 2), f"{name}_peak_memory_gib": gib(peak)}
    line["one_pass_over_two"] = ratio(results["one_pass"][0], results["a_pass_each"][0])
    check.finish(line, started)


def curate(check: Check, compiled: bool = False) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import clips
    import pyarrow.parquet as pq
    import torch
    from plain_curate import PlainScorer, scores_table

    from sdq.models.curate.clip import ScorerRef
    from sdq.models.store import LocalStore
    from sdq.workers.ahead import ahead_of_device
    from sdq.workers.curate.scoring import LoadedScorers, joined, prepare_batches, score_batch
    from sdq.workers.curate.work import BATCHES_AHEAD, DECODE_THREADS
    from sdq.workers.shards.embeddings import embedding_shard_bytes
    from sdq.workers.weights import ModelFiles

    started = time.monotonic()
    small, size = check.args.small, sized(check, "curate")
    dtype = getattr(torch, size["dtype"])
    if small:
        shape = (clips.NARROW_VISION, clips.NARROW_TEXT, clips.NARROW_WIDTH)
    else:
        shape = (clips.VIT_L14_VISION, clips.VIT_L14_TEXT, clips.VIT_L14_WIDTH)
    clip = clips.build_clip(check.scratch / "clip", *shape, dtype=dtype)
    head = clips.build_head(check.scratch / "aesthetic.safetensors", shape[2])
    store = LocalStore(check.scratch / "store")
    store.put_bytes("heads/aesthetic.safetensors", head.read_bytes(), content_type=OCTETS)
    ref = ScorerRef(str(clip), "device-check", aesthetic_head="heads/aesthetic.safetensors")
    scorer = LoadedScorers(ModelFiles(store, check.scratch / "cache"), store).get(ref)
    plain = PlainScorer(clip, head, scorer.device, dtype)
    batch, width = size["batch"], shape[2]

    def sdq(shard) -> None:
        """The worker's curate of a shard (workers/curate/work.py), short of the store."""
        with ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="sdq-decode") as decoders:
            batches = prepare_batches(shard, scorer, batch_size=batch, decoders=decoders)
            batches = ahead_of_device(batches, BATCHES_AHEAD, scorer.device)
            scores = joined([score_batch(scorer, each) for each in batches], width=width)
            embedding_shard_bytes(shard.keys, scores.embeddings.astype("float16"), {})

    def plain_loop(shard) -> None:
        parts = [plain.score(shard.images[start : start + batch],
                             shard.captions[start : start + batch])
                 for start in range(0, len(shard), batch)]  # fmt: skip
        pq.write_table(scores_table(shard.keys, parts), check.scratch / "plain-scores.parquet")

    side = shape[0]["image_size"]
    flops = counted_flops(lambda: scorer.aesthetic(scorer.model(
        input_ids=torch.zeros(1, 77, dtype=torch.long, device=scorer.device),
        pixel_values=torch.zeros(1, 3, side, side, device=scorer.device, dtype=dtype),
    ).image_embeds.float()))  # fmt: skip
    weights = {"sdq": weight_bytes(scorer.model, scorer.aesthetic),
               "plain": weight_bytes(plain.model, plain.head)}  # fmt: skip
    shard = image_shard(check, size["images"], size["resolution"])
    results = in_turn({"sdq": sdq, "plain": plain_loop}, shard, size["rounds"], weights)
    line = {"part": "curate", "measure": "eager", "model": "narrow" if small else "vit-l14-shape"}
    line |= {name: size[name] for name in ("images", "resolution", "batch", "dtype")}
    check.finish(line | sides_line(results, flops, "samples"), started)


def sides_line(results: dict, flops: float | None, unit: str) -> dict:
    line: dict = {}
    for name, (speed, peak) in results.items():
        line |= {f"{name}_{unit}_per_s": round(speed, 2), f"{name}_mfu": mfu(flops, speed),
                 f"{name}_peak_memory_gib": gib(peak)}  # fmt: skip
    line["sdq_vs_plain"] = ratio(results["sdq"][0], results["plain"][0])
    return line


# --- the check ---------------------------------------------------------------------------

RUN = {"train": train, "generate": generate, "encode": encode, "curate": curate}
# A part's measurements besides eager and compiled, each a function of its own.
OTHER_MEASURES = {("encode", "resolutions"): encode_resolutions}


def load(check: Check, parts: list[str]) -> None:
    """The libraries and sdq's modules the parts use, imported once, timed apart."""
    started = time.monotonic()
    check.running = {"step": "imports"}
    modules = [name for part in parts for name in MODULES[part]]
    for name in modules:
        importlib.import_module(name)
    check.imported = True
    check.emit({"imports_s": round(time.monotonic() - started, 1), "modules": modules})


def about_device(args: argparse.Namespace) -> dict:
    import torch

    line = {"device": "cpu", "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "cpus": os.cpu_count()}  # fmt: skip
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        line |= {"device": properties.name,
                 "device_memory_gib": round(properties.total_memory / 2**30, 1)}  # fmt: skip
    try:
        from importlib.metadata import version

        line["sdq"] = version("sdq")
    except Exception:
        line["sdq"] = None
    return line | {"budget_s": args.budget_s, "small": args.small, "parts": args.parts,
                   "measures": args.measures, "compile_mode": args.compile_mode}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=480, help="the whole check's seconds")
    parser.add_argument("--parts", default=",".join(PARTS), help="of " + ",".join(PARTS))
    parser.add_argument("--measures", default=",".join(MEASURES), help="of " + ",".join(MEASURES))
    parser.add_argument("--small", action="store_true", help="a CPU check: tiny shapes")
    parser.add_argument(
        "--compile-mode", default="reduce-overhead",
        help="generation's SDQ_COMPILE_MODE: reduce-overhead and max-autotune replay CUDA "
        "graphs; max-autotune (sdq's default) tunes its kernels for minutes more",
    )  # fmt: skip
    args = parser.parse_args()
    args.parts = [part for part in args.parts.split(",") if part]
    args.measures = [measure for measure in args.measures.split(",") if measure]
    if unknown := set(args.parts) - set(PARTS) | set(args.measures) - set(MEASURES):
        parser.error(f"unknown parts or measures: {', '.join(sorted(unknown))}")
    if args.small:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: the CPU, as said
    check = Check(args)
    check.watch()
    check.emit(about_device(args))
    for part, measure in SCHEDULE:
        if part not in args.parts or measure not in args.measures:
            continue
        if not check.fits(check.estimate(part, measure), part=part, measure=measure):
            continue
        if not check.imported:
            load(check, args.parts)
        check.running = {"part": part, "measure": measure}
        try:
            measured = OTHER_MEASURES.get((part, measure), RUN[part])
            measured(check, compiled=measure == "compiled")
        except Exception as error:
            traceback.print_exc()
            check.failed.append(f"{part} {measure}")
            check.emit({"part": part, "measure": measure,
                        "error": f"{type(error).__name__}: {error}"[:1000]})  # fmt: skip
        finally:
            check.running = {"step": "between measurements"}
            free()
    check.end()


if __name__ == "__main__":
    main()
