"""Training on sdq against a plain loop: the same latent shards, the same steps.

The latent shards are made once, untimed: generated JPEGs served over local HTTP, through
`sdq download` and `sdq encode` with the tiny model. Then, in interleaved rounds,
  - plain: one process, the shards read into memory before the clock starts, the same
    optimizer steps (`train_step`, plain PyTorch: AdamW, DDPM noise, min-SNR MSE, EMA);
  - sdq: `sdq train --wait` end to end, one `sdq worker gpu` process, shards read from an
    S3 server over HTTP, a checkpoint (state and model) written to it every K steps, every
    step's loss in Postgres.
Prints one JSON object with samples/s of each, `sdq_vs_plain`, and how sdq's time splits
between optimizer steps and the rest (mostly checkpoint writing).

    python benchmarks/train.py [--images 256] [--steps 1200] [--checkpoint-every 300]
        [--batch-size 8] [--rounds 3]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import boto3
import psycopg
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.download import COMMAND_TIMEOUT, download_dataset  # noqa: E402
from sdq.models.registry import tiny_identity  # noqa: E402
from sdq.models.training import LatentInput, TrainOptions, TrainShardSpec  # noqa: E402
from sdq.workers.train.data import LatentStream  # noqa: E402
from sdq.workers.train.trainer import base_unet, new_state, train_step  # noqa: E402
from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

DATASET = "train-bench"
RESOLUTION = 64


def make_latents(env: dict[str, str], args) -> None:
    download_dataset(
        env, args.image_dir, images=args.images, name=DATASET, resolution=RESOLUTION,
        rows_per_shard=64,
    )  # fmt: skip
    sdq_json(env, "encode", DATASET, "--model", "tiny", "--resolution", str(RESOLUTION), "--wait")


def options(args) -> list[str]:
    return [
        "--base", "tiny", "--resolution", str(RESOLUTION), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--checkpoint-every", str(args.checkpoint_every),
    ]  # fmt: skip


def through_sdq(env: dict[str, str], args) -> tuple[float, dict[str, float]]:
    """Samples/s end to end, and the shares of the time spent in optimizer steps and in the
    rest of the jobs (starting from or writing checkpoints, reading shards)."""
    started = time.perf_counter()
    status = sdq_json(env, "train", DATASET, *options(args), "--wait", timeout=COMMAND_TIMEOUT)
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


def latent_inputs(env: dict[str, str]) -> tuple[LatentInput, ...]:
    """The benchmark dataset's latent shards, as a run reads them."""
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        rows = connection.execute("SELECT uri, samples FROM latent_shards ORDER BY id")
        return tuple(
            LatentInput(uri=uri, key=uri.split(f"{BENCH_BUCKET}/", 1)[1], samples=n)
            for uri, n in rows
        )


def plain_spec(inputs: tuple[LatentInput, ...], options: TrainOptions) -> TrainShardSpec:
    """One train-shard job of the tiny model over all the steps: what a plain loop runs."""
    model = tiny_identity()
    return TrainShardSpec(
        run=0, first_step=0, last_step=options.steps, model_name="plain",
        base_name=model.name, base_source=model.source, base_revision=model.revision,
        prediction_type="epsilon", scheduler_config=model.scheduler_config,
        options=options, inputs=inputs,
    )  # fmt: skip


class PlainLoop:
    """The same steps in this process, the shards in memory before the clock starts."""

    def __init__(self, env: dict[str, str], args) -> None:
        self.args = args
        inputs = latent_inputs(env)
        bucket = boto3.resource("s3").Bucket(BENCH_BUCKET)
        files = {item.key: bucket.Object(item.key).get()["Body"].read() for item in inputs}
        self.stream = LatentStream(
            inputs, seed=0, batch_size=args.batch_size, read=files.__getitem__
        )
        self.spec = plain_spec(inputs, TrainOptions(steps=args.steps, batch_size=args.batch_size))
        self.batches = [
            (torch.from_numpy(b.latents), torch.from_numpy(b.text_embeddings))
            for b, _ in zip(self.stream.batches(0), range(args.steps), strict=False)
        ]

    def run(self) -> float:
        state = new_state(self.spec, base_unet(self.spec, files=None))
        started = time.perf_counter()
        for latents, embeddings in self.batches:
            train_step(state, self.spec, latents, embeddings)
        return self.args.steps * self.args.batch_size / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--checkpoint-every", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"sdq": [], "plain": []}
    shares: dict[str, list[float]] = {"steps": [], "checkpoints": []}
    with deployment(broker_db=15) as env:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        worker = WorkerProcess(env, Path(env["SDQ_HOME"]) / "gpu.log").start()
        try:
            make_latents(env, args)
            plain = PlainLoop(env, args)
            for _ in range(args.rounds):
                rate, round_shares = through_sdq(env, args)
                rates["sdq"].append(rate)
                for name, share in round_shares.items():
                    shares[name].append(share)
                rates["plain"].append(plain.run())
        finally:
            worker.stop()
    ratios = [s / p for s, p in zip(rates["sdq"], rates["plain"], strict=True)]
    print(
        json.dumps(
            {
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
