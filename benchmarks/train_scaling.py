"""Data-parallel training on sdq against plain DDP under torchrun: the same latent shards,
the same global batch and steps, at each world size.

The latent shards are made once, untimed: generated JPEGs served over local HTTP, through
`sdq download` and `sdq encode` with the tiny model. Both sides train the U-Net `--unet`
names (benchmarks/train.py: SD 2's at a tenth of its width by default). Then, in
interleaved rounds, for each world size N:
  - sdq: `sdq train --world-size N --wait` end to end, one train worker (`sdq worker gpu
    --train-ranks N`) whose job runs on N rank processes (gloo on CPU, NCCL on GPUs),
    shards read from an S3 server over HTTP, a checkpoint written to it, every step's loss
    in Postgres;
  - plain: `torchrun --nproc-per-node N benchmarks/plain_ddp.py`, the loop diffusers'
    train_text_to_image.py runs (a DataLoader with a DistributedSampler over the same shards
    on local disk, DDP, AdamW, DDPM noise, min-SNR MSE, EMA), written apart from sdq and
    importing nothing of it, no checkpoint.
Both are timed from the command's start to its end, process starts included; sdq's run
is a chain of jobs of --checkpoint-every steps, each ending in a checkpoint written to S3.
Each starts once the worker sits idle: a long-lived train worker forks a run's rank
processes from its rank fork server, which has imported torch and the trainer before, as it
does in service, and plain torchrun starts its own with the command.
Prints one JSON object: samples/s of each, the scaling efficiency of each (samples/s at N
over N times samples/s at 1), `sdq_time_shares` (of sdq's run's wall time: its start up
to the first step, training, data waits, checkpoint waits, between jobs, the run's final
checkpoint), `sdq_stalls` (what each job costs the training beside its steps: the job gaps
and checkpoint waits, at --checkpoint-every steps a job) and `sdq_vs_plain` at each world
size.

With --lora-rank R both sides train a LoRA of rank R on the U-Net instead (sdq: `--lora-rank
R --ema 0` over the tiny pipeline with that U-Net, pushed; plain: the loop of diffusers'
train_text_to_image_lora.py, benchmarks/plain_ddp.py --lora-rank), from the same weights.

    python benchmarks/train_scaling.py [--world-sizes 1,2] [--steps 300]
        [--checkpoint-every 100] [--batch-size 8] [--images 256] [--rounds 3]
        [--unet sd2-narrow|tiny] [--lora-rank R]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.download import COMMAND_TIMEOUT  # noqa: E402
from benchmarks.train import (  # noqa: E402
    DATASET,
    PlainLoop,
    add_unet_option,
    make_latents,
    push_lora_base,
    train_options,
)
from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import deployment  # noqa: E402


def settled(worker: WorkerProcess, timeout: float = 60.0) -> None:
    """Until the worker's processes (its rank fork server too) sit idle: what it does
    between runs (the last run's ranks ending) is on neither side's clock."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        processes = []
        for pid in worker.children():  # a process listed may be gone by the time it is read
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                process.cpu_percent(None)
                processes.append(process)
        time.sleep(0.5)
        busy = 0.0
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                busy += process.cpu_percent(None)
        if busy < 10:  # percent of one core
            return


def through_sdq(
    env: dict[str, str], args, folder: Path, world_size: int
) -> tuple[float, dict[str, float]]:
    """Samples/s from the command's start to its end, and the shares of the run's wall time
    (first job's start to last checkpoint) that `sdq train status` reports."""
    started = time.perf_counter()
    status = sdq_json(
        env, "train", DATASET, *train_options(args, folder), "--world-size", str(world_size),
        "--wait", timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    assert status["status"] == "succeeded", status
    return args.steps * args.batch_size / seconds, status["time_shares"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    add_unet_option(parser)
    parser.add_argument("--lora-rank", type=int, help="train a LoRA of this rank, both sides")
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.world_sizes.split(",")]
    rates = {f"{way}_{size}": [] for size in sizes for way in ("sdq", "plain")}
    shares: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    with deployment() as env, tempfile.TemporaryDirectory() as folder:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        home = Path(env["SDQ_HOME"])
        worker = WorkerProcess(
            env, home / "gpu.log", args=("--train-ranks", str(max(sizes)))
        ).start()
        try:
            if args.lora_rank:
                push_lora_base(env, Path(folder), args.unet)
            make_latents(env, args)
            plain = PlainLoop(env, Path(folder), args.unet)
            for _ in range(args.rounds):
                for size in sizes:
                    settled(worker)
                    rate, round_shares = through_sdq(env, args, Path(folder), size)
                    rates[f"sdq_{size}"].append(rate)
                    shares[size].append(round_shares)
                    settled(worker)
                    rates[f"plain_{size}"].append(plain.run(args, size))
        finally:
            worker.stop()
    median = {name: statistics.median(values) for name, values in rates.items()}
    first = sizes[0]
    print(
        json.dumps(
            {
                "unet": args.unet,
                "lora_rank": args.lora_rank,
                "steps": args.steps,
                "global_batch": args.batch_size,
                "cores": os.cpu_count(),
                "samples_per_second": {name: round(value, 2) for name, value in median.items()},
                "rounds": {name: [round(r, 2) for r in values] for name, values in rates.items()},
                "scaling_efficiency": {
                    f"{way}_{size}": round(
                        median[f"{way}_{size}"] / (median[f"{way}_{first}"] * size / first), 3
                    )
                    for way in ("sdq", "plain")
                    for size in sizes
                },
                # Of sdq's wall time per run: its start, training, data waits, checkpoint
                # waits, between jobs and the final checkpoint (medians over the rounds).
                "sdq_time_shares": {
                    str(size): {
                        name: round(statistics.median(r[name] for r in shares[size]), 4)
                        for name in shares[size][0]
                    }
                    for size in sizes
                },
                "sdq_stalls": {
                    str(size): round(
                        statistics.median(r["job_gap"] + r["checkpoint"] for r in shares[size]), 4
                    )
                    for size in sizes
                },
                "sdq_vs_plain": {
                    str(size): round(median[f"sdq_{size}"] / median[f"plain_{size}"], 3)
                    for size in sizes
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
