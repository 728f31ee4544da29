"""Training on sdq against a plain loop: the same latent shards, the same steps.

The latent shards are made once, untimed: generated JPEGs served over local HTTP, through
`sdq download` and `sdq encode` with the tiny model. Both sides train the U-Net `--unet`
names: by default SD 2's at a tenth of its width (sdq: `--from-scratch --unet-config`), or
the tiny model's. Then, in interleaved rounds,
  - plain: benchmarks/plain_ddp.py under torchrun with one process, the loop diffusers'
    train_text_to_image.py runs (a DataLoader over the shards on local disk, AdamW, DDPM
    noise, min-SNR MSE, EMA), nothing of sdq's; timed from its start, as sdq is;
  - sdq: `sdq train --wait` end to end, one `sdq worker gpu` process, shards read from an
    S3 server over HTTP, a checkpoint (state and model) written to it every K steps, every
    step's loss in Postgres.
Prints one JSON object with samples/s of each, `sdq_vs_plain`, and how sdq's time splits
between optimizer steps and the rest (mostly checkpoint writing).

    python benchmarks/train.py [--images 256] [--steps 1200] [--checkpoint-every 300]
        [--batch-size 8] [--rounds 3] [--unet sd2-narrow|tiny]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.download import COMMAND_TIMEOUT, download_dataset  # noqa: E402
from benchmarks.unets import UNETS  # noqa: E402
from sdq.models.registry import tiny_identity  # noqa: E402
from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

DATASET = "train-bench"
RESOLUTION = 64
# What LoRA runs adapt (--lora-rank): the tiny pipeline around the --unet U-Net, pushed.
LORA_BASE = "bench-lora-base"


def make_latents(env: dict[str, str], args) -> None:
    download_dataset(
        env, args.image_dir, images=args.images, name=DATASET, resolution=RESOLUTION,
        rows_per_shard=64,
    )  # fmt: skip
    model = LORA_BASE if getattr(args, "lora_rank", None) else "tiny"
    sdq_json(env, "encode", DATASET, "--model", model, "--resolution", str(RESOLUTION), "--wait")


def push_lora_base(env: dict[str, str], folder: Path, unet: str) -> None:
    """The base LoRA runs adapt: the tiny pipeline with the `--unet` U-Net in its place
    (weights drawn from seed 0), saved in `folder`/base and pushed as LORA_BASE; the plain
    loop loads the same U-Net folder."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from sdq.workers.tiny import build_pipeline

    pipeline = build_pipeline()
    if unet != "tiny":
        torch.manual_seed(0)
        new_unet = UNet2DConditionModel.from_config(UNETS[unet])
        pipeline = StableDiffusionPipeline(**{**pipeline.components, "unet": new_unet})
    pipeline.save_pretrained(folder / "base")
    sdq_json(env, "model", "push", str(folder / "base"), LORA_BASE)


def train_options(args, folder: Path) -> list[str]:
    """`sdq train`'s options: the tiny base (its noise schedule, text encoder and VAE), and
    the U-Net `--unet` names trained from scratch unless it is tiny's own; the plain loop
    reads the same config file (PlainLoop writes it). With --lora-rank, a LoRA of that rank
    on LORA_BASE, with no EMA (diffusers' LoRA script keeps none)."""
    if getattr(args, "lora_rank", None):
        model = ["--base", LORA_BASE, "--lora-rank", str(args.lora_rank), "--ema", "0"]
    elif args.unet == "tiny":
        model = ["--base", "tiny"]
    else:
        model = ["--base", "tiny", "--from-scratch", "--unet-config", str(folder / "unet.json")]
    return [
        *model, "--resolution", str(RESOLUTION), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--checkpoint-every", str(args.checkpoint_every),
    ]  # fmt: skip


def add_unet_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--unet", choices=["sd2-narrow", "tiny"], default="sd2-narrow")


def through_sdq(env: dict[str, str], args, folder: Path) -> tuple[float, dict[str, float]]:
    """Samples/s end to end, and the shares of the time spent in optimizer steps and in the
    rest of the jobs (starting from or writing checkpoints, reading shards)."""
    started = time.perf_counter()
    status = sdq_json(
        env, "train", DATASET, *train_options(args, folder), "--wait", timeout=COMMAND_TIMEOUT
    )
    seconds = time.perf_counter() - started
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        [stepping] = connection.execute(
            "SELECT sum(%s / samples_per_second) FROM train_steps WHERE run_id = %s",
            (args.batch_size, status["run_id"]),
        ).fetchone()
        [in_jobs] = connection.execute(
            "SELECT sum(extract(epoch FROM finished_at - started_at)) FROM jobs WHERE run_id = %s",
            (status["run_id"],),
        ).fetchone()
    shares = {"steps": stepping / seconds, "checkpoints": (float(in_jobs) - stepping) / seconds}
    return args.steps * args.batch_size / seconds, shares


class PlainLoop:
    """benchmarks/plain_ddp.py under torchrun: the shards copied to local disk before any
    clock starts, the U-Net and the tiny model's noise schedule given as config files."""

    def __init__(self, env: dict[str, str], folder: Path, unet: str) -> None:
        self.folder = folder
        bucket = boto3.resource("s3").Bucket(BENCH_BUCKET)
        with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
            uris = [uri for (uri,) in connection.execute("SELECT uri FROM latent_shards")]
        for uri in uris:
            key = uri.split(f"{BENCH_BUCKET}/", 1)[1]
            (folder / "shards" / key).parent.mkdir(parents=True, exist_ok=True)
            bucket.download_file(key, str(folder / "shards" / key))
        (folder / "unet.json").write_text(json.dumps(UNETS[unet]))
        (folder / "scheduler.json").write_text(json.dumps(tiny_identity().scheduler_config))

    def _unet(self, args) -> list[str]:
        """The U-Net it trains: from the config, or LORA_BASE's under a LoRA."""
        if getattr(args, "lora_rank", None):
            pretrained = str(self.folder / "base/unet")
            return ["--unet-pretrained", pretrained, "--lora-rank", str(args.lora_rank)]
        return ["--unet-config", str(self.folder / "unet.json")]

    def run(self, args, world_size: int = 1) -> float:
        """Samples/s from the command's start to its end, process starts included."""
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world_size), str(ROOT / "benchmarks/plain_ddp.py"),
            "--shards", str(self.folder / "shards"),
            *self._unet(args), "--scheduler-config", str(self.folder / "scheduler.json"),
            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        ]  # fmt: skip
        # Each rank its share of the cores, as torchrun's users set it. (sdq's ranks give
        # torch half of theirs, beside their staging threads: models/cores.py.)
        threads = max(1, (os.cpu_count() or 1) // world_size)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        started = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=COMMAND_TIMEOUT)
        return args.steps * args.batch_size / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--checkpoint-every", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    add_unet_option(parser)
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"sdq": [], "plain": []}
    shares: dict[str, list[float]] = {"steps": [], "checkpoints": []}
    with deployment() as env, tempfile.TemporaryDirectory() as folder:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        worker = WorkerProcess(env, Path(env["SDQ_HOME"]) / "gpu.log").start()
        try:
            make_latents(env, args)
            plain = PlainLoop(env, Path(folder), args.unet)
            for _ in range(args.rounds):
                rate, round_shares = through_sdq(env, args, Path(folder))
                rates["sdq"].append(rate)
                for name, share in round_shares.items():
                    shares[name].append(share)
                rates["plain"].append(plain.run(args))
        finally:
            worker.stop()
    ratios = [s / p for s, p in zip(rates["sdq"], rates["plain"], strict=True)]
    print(
        json.dumps(
            {
                "unet": args.unet,
                "steps": args.steps,
                "batch_size": args.batch_size,
                "checkpoint_every": args.checkpoint_every,
                "samples_per_second": {
                    name: round(statistics.median(values), 2) for name, values in rates.items()
                },
                "rounds": {name: [round(r, 2) for r in values] for name, values in rates.items()},
                # Of sdq's wall time: optimizer steps, the rest of the jobs (checkpoints
                # written and read, shards read); what is left is the command and the queue.
                "sdq_time_shares": {
                    name: round(statistics.median(values), 3) for name, values in shares.items()
                },
                "sdq_vs_plain": round(statistics.median(ratios), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
