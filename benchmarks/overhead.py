"""What the queue, the database and the store cost, measured side by side in one run.

The same prompts on the tiny model, 64x64, 20 steps:
  (a) a plain diffusers loop in this process, one image per call, PNGs to a local folder;
  (b) the same loop at sdq's batch size;
  (c) `sdq submit` to one `sdq worker gpu` process on Redis + Postgres + S3 (moto server),
      timed from the submit to the last image recorded as stored.
Both sides load the pipeline before the clock starts. Prints one JSON object.

    python benchmarks/overhead.py [--prompts 64] [--batch-size 8] [--steps 20]
"""

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import psycopg
import torch
from click.testing import CliRunner
from sqlalchemy import func, select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.db import make_engine, session_factory  # noqa: E402
from models.tables import FINISHED, Job  # noqa: E402
from producer.cli import main as sdq  # noqa: E402
from tests.conftest import WorkerProcess  # noqa: E402
from tests.services import MotoServer, aws_env, clean_env, ensure_service  # noqa: E402
from workers.tiny import build_pipeline  # noqa: E402

SUBJECTS = [
    "a lighthouse", "a fox", "an old library", "a paper boat", "a mountain village",
    "a robot gardener", "a koi pond", "a desert caravan",
]  # fmt: skip
STYLES = ["ink", "oil paint", "pixel art", "watercolor", "charcoal", "bauhaus", "ukiyo-e", "neon"]


def prompts(count: int) -> list[tuple[str, int]]:
    grid = [f"{subject}, {style}" for style in STYLES for subject in SUBJECTS]
    return [(f"{grid[index % len(grid)]} #{index}", 1000 + index) for index in range(count)]


def plain_loop(work: list[tuple[str, int]], *, batch_size: int, steps: int, size: int) -> float:
    """The plain way: one process, one pipeline, PNG files in a folder. Returns seconds."""
    pipeline = build_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    pipeline(prompt="warm-up", num_inference_steps=2, width=size, height=size)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        for start in range(0, len(work), batch_size):
            chunk = work[start : start + batch_size]
            images = pipeline(
                prompt=[prompt for prompt, _ in chunk],
                num_inference_steps=steps,
                width=size,
                height=size,
                generator=[torch.Generator("cpu").manual_seed(seed) for _, seed in chunk],
            ).images
            for (_, seed), image in zip(chunk, images, strict=True):
                image.save(Path(folder) / f"{seed}.png")
        return time.perf_counter() - started


def deployment() -> tuple[dict[str, str], MotoServer, str]:
    ensure_service("postgres")
    ensure_service("redis")
    database = f"sdq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1/postgres", autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{database}"')
    s3 = MotoServer().start()
    boto3.client("s3", **_client_args(s3.endpoint)).create_bucket(Bucket="sdq-bench")
    home = Path(tempfile.mkdtemp(prefix="sdq-bench-"))
    env = {
        **clean_env(),
        **aws_env(s3.endpoint),
        "SDQ_DATABASE_URL": f"postgresql://postgres@127.0.0.1/{database}",
        "SDQ_BROKER_URL": "redis://127.0.0.1:6379/12",
        "SDQ_STORE_URL": "s3://sdq-bench/bench",
        "SDQ_HOME": str(home),
    }
    return env, s3, database


def _client_args(endpoint: str) -> dict[str, str]:
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


def submit(env: dict[str, str], csv: Path, *options: str) -> int:
    result = CliRunner().invoke(sdq, ["submit", str(csv), "--json", *options], env=env)
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return json.loads(result.stdout)["run_id"]


def wait(sessions, run_id: int, total: int) -> None:
    finished = select(func.count()).where(Job.run_id == run_id, Job.status.in_(FINISHED))
    while True:
        with sessions() as session:
            if session.scalar(finished) >= total:
                return
        time.sleep(0.01)


def through_sdq(work: list[tuple[str, int]], *, batch_size: int, steps: int, size: int) -> float:
    env, s3, database = deployment()
    os.environ.update({key: env[key] for key in env if key.startswith(("SDQ_", "AWS_"))})
    from migrations import upgrade

    engine = make_engine(env["SDQ_DATABASE_URL"])
    upgrade(engine)
    sessions = session_factory(engine)
    home = Path(env["SDQ_HOME"])
    worker = WorkerProcess(env, home / "worker.log").start()
    try:
        options = [
            "--steps",
            str(steps),
            "--size",
            f"{size}x{size}",
            "--batch-size",
            str(batch_size),
        ]
        warm_up = write_csv(home / "warm-up.csv", [("warm-up", 1)])
        wait(sessions, submit(env, warm_up, *options), 1)
        csv = write_csv(home / "prompts.csv", work)
        started = time.perf_counter()
        run_id = submit(env, csv, *options)
        wait(sessions, run_id, len(work))
        return time.perf_counter() - started
    finally:
        worker.stop()
        s3.stop()
        engine.dispose()
        with psycopg.connect("postgresql://postgres@127.0.0.1/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def write_csv(path: Path, work: list[tuple[str, int]]) -> Path:
    lines = ["prompt,seed"] + [f'"{prompt}",{seed}' for prompt, seed in work]
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    work = prompts(args.prompts)
    shape = {"steps": args.steps, "size": args.size}
    plain_one = plain_loop(work, batch_size=1, **shape)
    plain_batched = plain_loop(work, batch_size=args.batch_size, **shape)
    queued = through_sdq(work, batch_size=args.batch_size, **shape)
    seconds = {"plain_batch1": plain_one, "plain_batched": plain_batched, "sdq": queued}
    rate = {name: len(work) / elapsed for name, elapsed in seconds.items()}
    print(
        json.dumps(
            {
                "images": len(work),
                "steps": args.steps,
                "size": f"{args.size}x{args.size}",
                "batch_size": args.batch_size,
                "images_per_second": {name: round(value, 2) for name, value in rate.items()},
                "sdq_vs_plain_batch1": round(rate["sdq"] / rate["plain_batch1"], 3),
                "sdq_vs_plain_batched": round(rate["sdq"] / rate["plain_batched"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
