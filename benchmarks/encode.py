"""Encoding at scale: `sdq encode` against a plain batched loop on the same image shards.

The image shards are made once, untimed: N generated JPEGs of mixed sizes served over
local HTTP, through `sdq download` at the encoding resolution. Then, in interleaved
rounds, the same shards go through
  - sdq: `sdq encode --wait` end to end, one `sdq worker gpu` process (Redis, Postgres,
    shards read from and latents written to an S3 server over HTTP, lineage in SQL);
  - plain: one process, a batched loop over the same tiny VAE and text encoder: shards
    read from the same S3 server, images decoded and normalized, the same per-sample
    seeds, latents and embeddings written to local parquet files;
  - Ray Data (when `ray` is installed): read_parquet from the same S3 server, the same
    encoding as a `map_batches` class on one actor, write_parquet to a local folder.
Every side builds its models before the clock starts (sdq in a warm-up round), and each
round encodes afresh: the earlier round's encode runs are deleted, so nothing is served
from the cache. Prints one JSON object with samples/s of each (medians over rounds) and
`sdq_vs_plain` (the median of the per-round ratios).

    python benchmarks/encode.py [--images 2048] [--rounds 3] [--resolution 256]
        [--batch-size 32]

With `--resolutions 256,512` it measures one pass against one pass per resolution
instead, both through sdq over the same shards (downloaded at the largest): `sdq encode
--resolutions 256,512` decodes each image and encodes each caption once, where two runs
of `--resolutions 256` and `--resolutions 512` do both twice. `one_pass_over_two` is the
two passes' seconds over the one pass's (the median of the per-round ratios).
"""

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import boto3
import numpy as np
import psycopg
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.download import COMMAND_TIMEOUT, download_dataset  # noqa: E402
from benchmarks.plain_encode import PlainEncoder, save  # noqa: E402
from sdq.models.datasets import latent_seed  # noqa: E402
from sdq.workers.tiny import build_text_encoder, build_tokenizer, build_vae  # noqa: E402
from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import BENCH_BUCKET, deployment  # noqa: E402

DATASET = "encode-bench"
ROWS_PER_SHARD = 256


def make_dataset(env: dict[str, str], args) -> None:
    summary = download_dataset(
        env, args.image_dir, images=args.images, name=DATASET, resolution=args.resolution,
        rows_per_shard=ROWS_PER_SHARD,
    )  # fmt: skip
    print(f"dataset: {summary['by_status']} {summary['reasons']}", file=sys.stderr)


def forget_encodings(database_url: str) -> None:
    """As if the dataset had never been encoded: the next encode does all the work."""
    with psycopg.connect(database_url) as connection:
        connection.execute("DELETE FROM runs WHERE kind = 'encode'")
        connection.execute("DELETE FROM latent_shards")


def through_sdq(env: dict[str, str], args) -> tuple[float, float]:
    """Samples/s end to end, and the share of the time the worker spent in its jobs."""
    summary, seconds = encoded(env, args, "--resolution", str(args.resolution))
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        [working] = connection.execute(
            "SELECT sum(extract(epoch FROM finished_at - started_at)) FROM jobs "
            "WHERE kind = 'encode'"
        ).fetchone()
    return summary["latents"][0]["samples"] / seconds, float(working) / seconds


def encoded(env: dict[str, str], args, *targets: str) -> tuple[dict, float]:
    """`sdq encode --wait` afresh at the targets: its summary, and its seconds."""
    forget_encodings(env["SDQ_DATABASE_URL"])
    started = time.perf_counter()
    summary = sdq_json(
        env, "encode", DATASET, "--model", "tiny", *targets, "--batch-size",
        str(args.batch_size), "--wait", timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    return summary, time.perf_counter() - started


def one_pass_over_two(env: dict[str, str], args) -> dict:
    """Per round: one pass at every resolution against a pass at each, in turn."""
    resolutions = args.resolutions.split(",")
    encoded(env, args, "--resolutions", args.resolutions)  # warm-up
    ratios, one, each = [], [], []
    for _ in range(args.rounds):
        one.append(encoded(env, args, "--resolutions", args.resolutions)[1])
        each.append(sum(encoded(env, args, "--resolutions", r)[1] for r in resolutions))
        ratios.append(each[-1] / one[-1])
    seconds = {"one_pass": one, "a_pass_each": each}
    return {
        "images": args.images,
        "resolutions": args.resolutions,
        "seconds": {side: [round(s, 2) for s in values] for side, values in seconds.items()},
        "one_pass_over_two": round(statistics.median(ratios), 3),
    }


class PlainLoop:
    """The way a script does it: read a shard, encode it batch by batch, save, repeat
    (benchmarks/plain_encode.py)."""

    def __init__(self, keys: list[str], args) -> None:
        self.bucket = boto3.resource("s3").Bucket(BENCH_BUCKET)
        self.keys, self.args = keys, args
        self.encoder = PlainEncoder(build_vae(), build_text_encoder(), build_tokenizer())
        self.output = Path(tempfile.mkdtemp(prefix="sdq-plain-encode-"))

    def run(self) -> float:
        started = time.perf_counter()
        samples = 0
        for number, key in enumerate(self.keys):
            table = pq.read_table(io.BytesIO(self.bucket.Object(key).get()["Body"].read()))
            table = table.filter(pc.equal(table["status"], "success"))
            if not len(table):
                continue
            latents, embeddings = [], []
            for start in range(0, len(table), self.args.batch_size):
                batch = table.slice(start, self.args.batch_size)
                latent, embedding = self.encoder.encode(
                    batch["jpg"].to_pylist(),
                    batch["caption"].to_pylist(),
                    seeds(batch["key"].to_pylist()),
                )
                latents.append(latent)
                embeddings.append(embedding)
            save(self.output / f"{number:05d}.parquet", table["key"], np.concatenate(latents),
                 np.concatenate(embeddings))  # fmt: skip
            samples += len(table)
        return samples / (time.perf_counter() - started)


def seeds(keys) -> list[int]:
    """The samples' seeds as sdq draws them, so every side draws the same latents."""
    return [latent_seed(DATASET, key) for key in list(keys)]


class RayEncoder:
    """Ray Data's way: the same encoding as a map_batches callable class, one actor."""

    def __init__(self) -> None:
        self.encoder = PlainEncoder(build_vae(), build_text_encoder(), build_tokenizer())

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        latents, embeddings = self.encoder.encode(
            list(batch["jpg"]), list(batch["caption"]), seeds(batch["key"])
        )
        return {"key": batch["key"], "latents": latents, "text_embeddings": embeddings}


def through_ray(keys: list[str], args) -> float:
    import pyarrow.fs
    import ray

    filesystem = pyarrow.fs.S3FileSystem(
        endpoint_override=os.environ["AWS_ENDPOINT_URL"],
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ["AWS_DEFAULT_REGION"],
    )
    output = tempfile.mkdtemp(prefix="sdq-ray-encode-")
    started = time.perf_counter()
    (
        ray.data.read_parquet(
            [f"{BENCH_BUCKET}/{key}" for key in keys],
            filesystem=filesystem,
            columns=["key", "caption", "status", "jpg"],
        )
        .filter(lambda row: row["status"] == "success")
        .map_batches(RayEncoder, batch_size=args.batch_size, concurrency=1, batch_format="numpy")
        .write_parquet(output)
    )
    seconds = time.perf_counter() - started
    return len(pq.read_table(output, columns=["key"])) / seconds


def start_ray() -> bool:
    """Starts Ray in this process when it is installed; says whether it is."""
    try:
        import ray
    except ImportError:
        return False
    ray.init(include_dashboard=False, log_to_driver=False)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--resolutions", metavar="R,R", help="one pass against one each")
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    args = parser.parse_args()
    if args.resolutions:
        args.resolution = max(int(r) for r in args.resolutions.split(","))
        with deployment() as env:
            make_dataset(env, args)
            worker = WorkerProcess(env, Path(env["SDQ_HOME"]) / "gpu.log").start()
            try:
                print(json.dumps(one_pass_over_two(env, args), indent=2))
            finally:
                worker.stop()
        return
    rates: dict[str, list[float]] = {"sdq": [], "plain": []}
    in_jobs: list[float] = []
    if start_ray():
        rates["ray_data"] = []
    with deployment() as env:
        os.environ.update(env)  # boto3 in this process reads AWS_* like the worker does
        make_dataset(env, args)
        worker = WorkerProcess(env, Path(env["SDQ_HOME"]) / "gpu.log").start()
        try:
            through_sdq(env, args)  # warm-up: the worker builds its encoders
            keys = [
                f"bench/datasets/{DATASET}/images/{n:05d}.parquet"
                for n in range(-(-args.images // ROWS_PER_SHARD))
            ]
            plain = PlainLoop(keys, args)
            for _ in range(args.rounds):
                rate, working = through_sdq(env, args)
                rates["sdq"].append(rate)
                in_jobs.append(working)
                rates["plain"].append(plain.run())
                if "ray_data" in rates:
                    rates["ray_data"].append(through_ray(keys, args))
        finally:
            worker.stop()
    medians = {name: round(statistics.median(values), 2) for name, values in rates.items()}
    ratios = [s / p for s, p in zip(rates["sdq"], rates["plain"], strict=True)]
    print(
        json.dumps(
            {
                "images": args.images,
                "resolution": args.resolution,
                "batch_size": args.batch_size,
                "samples_per_second": medians,
                "rounds": {name: [round(r, 2) for r in values] for name, values in rates.items()},
                # The rest of sdq's time: starting the command, planning, the queue, polling.
                "sdq_share_in_jobs": round(statistics.median(in_jobs), 3),
                "sdq_vs_plain": round(statistics.median(ratios), 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
