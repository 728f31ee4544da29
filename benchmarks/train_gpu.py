"""Training on one GPU at Stable Diffusion's shapes: sdq's rank loop against the plain loop.

An SD 2-shaped U-Net (866M parameters, models/train/architectures.py; `--architecture sd2-narrow`:
the train benchmarks' at a tenth of its width, benchmarks/unets.py) with random weights,
built in code, and latent shards of random fp16 latents and text embeddings in sdq's layout,
written once to a local folder, untimed. Then, in interleaved rounds on the same device:
  - plain: benchmarks/plain_ddp.py under torchrun with one process, the loop diffusers'
    train_text_to_image.py runs (a DataLoader, DDP, AdamW, bf16 autocast, EMAModel),
    importing nothing of sdq's; its samples/s over its steps after --warmup;
  - sdq: a rank's `Training` over the same shards, read through a LocalStore (the latent
    stream, pinned staging, the step, losses read every `loss_every` steps), its state kept
    from round to round as a worker keeps it from job to job; timed the same way.
Then --checkpoints checkpoints in a row (0 leaves them out), each as a job ends: how long the
steps wait for the state's copy to host memory (the first allocates its pinned buffers; the
later ones find them in torch's host cache), how long the write takes on its thread, and
samples/s while it is written.

Host syncs per sdq step are counted by CUDA's sync debug mode, by thread and place: those on
the step's thread let the device's queue run dry; the staging thread's wait for its copies
does not. MFU is the U-Net's training FLOPs per sample (torch's counter, x3 for the backward
pass) over the GPU's dense bf16 peak. Prints one JSON object; `sdq_vs_plain` is sdq's median
samples/s over plain's.

    python benchmarks/train_gpu.py [--architecture sd2-base|sd2-narrow] [--resolution 256]
        [--batch-size 64] [--steps 100] [--warmup 20] [--rounds 2] [--checkpoints 2]
        [--compile]
    python benchmarks/train_gpu.py --small      # a CPU check: the tiny U-Net, a few steps
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from diffusers import UNet2DConditionModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sd15 import SD15_SCHEDULER  # noqa: E402  (beside this script)
from unets import UNETS  # noqa: E402

from sdq.models.store import LocalStore  # noqa: E402
from sdq.models.train.settings import TrainSettings  # noqa: E402
from sdq.models.train.specs import (  # noqa: E402
    LatentInput,
    TrainOptions,
    TrainShardSpec,
    checkpoint_prefix,
)
from sdq.workers.gpu import peak_flops  # noqa: E402
from sdq.workers.shards.latents import Encoded, latent_shard_bytes  # noqa: E402
from sdq.workers.train.loop.build import new_state  # noqa: E402
from sdq.workers.train.loop.checkpoints import write_checkpoint  # noqa: E402
from sdq.workers.train.loop.training import Training  # noqa: E402
from sdq.workers.weights import ModelFiles  # noqa: E402

TOKENS = 77
CUDA = torch.cuda.is_available()


def never() -> bool:
    return False


def timer() -> float:
    """The time once the device has finished what it was given."""
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter()


def write_shards(store: LocalStore, config: dict, args) -> list[LatentInput]:
    """`--shards` shards of `--rows` samples in sdq's layout: fp16 tensors, fixed-size binary."""
    side = args.resolution // 8
    rng = np.random.default_rng(0)
    inputs = []
    for shard in range(args.shards):
        rows = args.rows
        encoded = Encoded(
            seeds=list(range(rows)),
            latents=rng.standard_normal(
                (rows, config["in_channels"], side, side), np.float32
            ).astype(np.float16),
            text_embeddings=rng.standard_normal(
                (rows, TOKENS, config["cross_attention_dim"]), np.float32
            ).astype(np.float16),
            token_ids=np.zeros((rows, TOKENS), np.int64),
        )
        lineage = {"key": [f"{shard}-{n}" for n in range(rows)], "url": ["bench"] * rows}
        key = f"latents/{shard:05d}.parquet"
        data = latent_shard_bytes(lineage, encoded, {"dataset": "bench"})
        store.put_bytes(key, data, content_type="application/vnd.apache.parquet")
        inputs.append(LatentInput(uri=store.uri(key), key=key, samples=rows))
    return inputs


class PlainLoop:
    """benchmarks/plain_ddp.py under torchrun, one process, over the shards' folder."""

    def __init__(self, folder: Path, config: dict, args, *, compile_backend: str | None = None):
        """`compile_backend`: the loop torch.compiles its model with that backend."""
        (folder / "unet.json").write_text(json.dumps(config))
        (folder / "scheduler.json").write_text(json.dumps(SD15_SCHEDULER))
        self.command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "1", str(ROOT / "benchmarks/plain_ddp.py"), "--shards", str(folder / "latents"),
            "--unet-config", str(folder / "unet.json"),
            "--scheduler-config", str(folder / "scheduler.json"),
            "--steps", str(args.warmup + args.steps), "--timed-from", str(args.warmup),
            "--batch-size", str(args.batch_size),
        ]  # fmt: skip
        if compile_backend:
            self.command += ["--compile", "--compile-backend", compile_backend]

    def run(self) -> dict:
        done = subprocess.run(self.command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the plain loop failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


class SdqRank:
    """One rank's training, as a train worker holds it from job to job."""

    def __init__(self, store: LocalStore, inputs: list[LatentInput], config: dict, args) -> None:
        self.store, self.batch_size = store, args.batch_size
        steps = args.warmup + (args.rounds + args.checkpoints) * args.steps
        self.spec = TrainShardSpec(
            run=1, first_step=0, last_step=0, model_name="bench", base_name="random",
            base_source="random", base_revision="bench", prediction_type="epsilon",
            scheduler_config=SD15_SCHEDULER, inputs=tuple(inputs),
            options=TrainOptions(steps=steps, batch_size=args.batch_size,
                                 checkpoint_every=steps, compile=args.compile),
        )  # fmt: skip
        torch.manual_seed(0)
        self.training = Training(
            self.spec, new_state(self.spec, UNet2DConditionModel(**config)), store, TrainSettings()
        )
        # cuDNN's autotuning, the FLOP count, compilation when asked, the first shards: the
        # first step apart (it holds the compilation), then the rest of the warm-up.
        started = timer()
        self.take(1)
        self.first_step_s = timer() - started
        if args.warmup > 1:
            self.take(args.warmup - 1)

    @property
    def step(self) -> int:
        return self.training.state.step

    def take(self, steps: int) -> list[dict]:
        return self.training.steps(replace(self.spec, last_step=self.step + steps), never)

    def timed(self, steps: int) -> dict:
        with host_syncs() as syncs:
            started = timer()
            taken = self.take(steps)
            seconds = timer() - started
        return {
            "samples_per_second": steps * self.batch_size / seconds,
            "host_syncs_per_step": {
                place: round(count / steps, 3) for place, count in syncs.items()
            },
            "data_wait_share": sum(step["data_wait_seconds"] for step in taken) / seconds,
        }

    def checkpoints(self, count: int, steps: int, cache: Path) -> list[dict]:
        return [self.checkpoint(steps, cache) for _ in range(count)]

    def checkpoint(self, steps: int, cache: Path) -> dict:
        """A checkpoint of the state only (not a model: the run's last step is far), written
        on a thread while `steps` more are taken."""
        spec = replace(self.spec, last_step=self.step)
        snapshot = self.training.checkpoint(spec)
        files = ModelFiles(self.store, cache)
        with ThreadPoolExecutor(1, thread_name_prefix="bench-checkpoint") as writer:
            started = timer()
            written = writer.submit(write_checkpoint, spec, snapshot, self.store, files)
            self.training.train_ahead(replace(spec, last_step=self.step + steps), never)
            trained = timer() - started
            written.result()
            writing = time.perf_counter() - started
        written_at = self.store.root / checkpoint_prefix(spec.run, spec.last_step)
        state_bytes = sum(path.stat().st_size for path in written_at.rglob("*") if path.is_file())
        return {
            "state_gb": round(state_bytes / 2**30, 3),
            "steps_waited_s": round(snapshot.seconds, 3),
            "written_in_s": round(writing, 2),
            "samples_per_second_while_writing": round(steps * self.batch_size / trained, 2),
        }


@contextmanager
def host_syncs() -> Iterator[Counter]:
    """The warnings CUDA's sync debug mode raises, one per call that waits for the device,
    counted by the thread that waited and the line that asked."""
    syncs: Counter = Counter()

    def note(message, category, filename, lineno, *_) -> None:
        if "synchronizing" in str(message):
            thread = "step" if threading.current_thread() is threading.main_thread() else "staging"
            syncs[f"{thread} {Path(filename).name}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        if CUDA:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            if CUDA:
                torch.cuda.set_sync_debug_mode("default")


def peak_memory_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if CUDA else None


def mfu(samples_per_second: float, flops_per_sample: float | None) -> float | None:
    peak = peak_flops(torch.device("cuda")) if CUDA else None
    if peak is None or flops_per_sample is None:
        return None
    return round(flops_per_sample * samples_per_second / peak, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a CPU check: the tiny U-Net")
    parser.add_argument("--architecture", default="sd2-base", choices=[*UNETS])
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="timed, per round and side")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--compile", action="store_true", help="sdq's U-Net torch.compiled")
    parser.add_argument("--checkpoints", type=int, default=2, help="in a row, at the end")
    args = parser.parse_args()
    if args.small:
        args.architecture, args.resolution, args.batch_size = "tiny", 64, 8
        args.steps, args.warmup, args.rounds, args.rows = 10, 2, 2, 64
    config = UNETS[args.architecture]
    with tempfile.TemporaryDirectory(prefix="sdq-train-gpu-") as scratch:
        folder = Path(scratch)
        store = LocalStore(folder)
        inputs = write_shards(store, config, args)
        plain = PlainLoop(folder, config, args)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        sdq = SdqRank(store, inputs, config, args)
        sides: dict[str, list[dict]] = {"plain": [], "sdq": []}
        for _ in range(args.rounds):
            sides["plain"].append(plain.run())
            sides["sdq"].append(sdq.timed(args.steps))
        sdq_peak = peak_memory_gb()
        checkpoints = sdq.checkpoints(args.checkpoints, args.steps, folder / "cache")
        sdq.training.close()  # its reading threads, before their shards' folder goes
    flops = sdq.training.state.flops_per_sample
    result: dict = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "architecture": args.architecture, "resolution": args.resolution,
        "batch_size": args.batch_size, "steps_per_round": args.steps, "rounds": args.rounds,
        "sdq_compiled": args.compile,
        "tflops_per_sample": round(flops / 1e12, 4) if flops else None,
    }  # fmt: skip
    for name, rounds in sides.items():
        speed = statistics.median(side["samples_per_second"] for side in rounds)
        result[name] = {
            "samples_per_second": round(speed, 2),
            "mfu": mfu(speed, flops),
            "rounds": [round(side["samples_per_second"], 2) for side in rounds],
        }
    result["plain"]["peak_memory_gb"] = max(
        (round(side["peak_memory_gb"], 2) for side in sides["plain"] if "peak_memory_gb" in side),
        default=None,
    )
    result["sdq"] |= {
        "peak_memory_gb": sdq_peak,
        "first_step_s": round(sdq.first_step_s, 2),
        "host_syncs_per_step": sides["sdq"][-1]["host_syncs_per_step"],
        "data_wait_share": round(max(side["data_wait_share"] for side in sides["sdq"]), 4),
        "checkpoints": checkpoints,
    }
    speeds = (result[name]["samples_per_second"] for name in ("sdq", "plain"))
    result["sdq_vs_plain"] = round(next(speeds) / next(speeds), 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
