"""Downloading at scale: `sdq download` against img2dataset on the same list, side by side.

A local HTTP server (its own process) serves N generated JPEGs of mixed sizes (480-1600
px). The same parquet list goes, in interleaved rounds, through
  - sdq: `sdq download --wait` end to end, one CPU worker process group (Redis, Postgres,
    shards to an S3 server over HTTP, every sample recorded in SQL);
  - img2dataset: its CLI, parquet output to a local folder,
both at 256 px center crop, JPEG, with the same processes and threads. Prints one JSON
object with images/s of each and `sdq_vs_img2dataset`.

    python benchmarks/download.py [--images 2000] [--rounds 3] [--processes 2] [--threads 16]
        [--img2dataset PATH]   # the img2dataset command, e.g. from a venv of its own
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import WorkerProcess, sdq_json  # noqa: E402
from tests.services import deployment, free_port, listening, wait_for  # noqa: E402

ROWS_PER_SHARD = 250
# The image server is on loopback, which downloads refuse unless allowed.
SERVER_ALLOWED = {"SDQ_DOWNLOAD_ALLOW_NETWORKS": "127.0.0.1/32"}
# A benchmark's command may run far longer than a test's.
COMMAND_TIMEOUT = 3600


def make_images(folder: Path, count: int) -> None:
    """Photo-like JPEGs (gradients and noise), 480 to 1600 px on a side; kept between runs."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        path = folder / f"{n}.jpg"
        if path.exists():
            continue
        # A generator per image: picture n is the same whether or not the ones before it
        # were made in this run (kept from an earlier one).
        rng = np.random.default_rng(n)
        width, height = (int(side) for side in rng.integers(480, 1601, size=2))
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([x * 255 / width, y * 255 / height, (x * y) % 255], -1)
        noise = rng.normal(0, 10, (height, width, 3))
        pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, "JPEG", quality=90)


def write_list(path: Path, port: int, count: int) -> None:
    urls = [f"http://127.0.0.1:{port}/{n}.jpg" for n in range(count)]
    pq.write_table(pa.table({"url": urls, "caption": [f"image {n}" for n in range(count)]}), path)


@contextmanager
def image_server(folder: Path, count: int) -> Iterator[int]:
    """The benchmark's images served over local HTTP by a process of their own; yields the
    port."""
    make_images(folder, count)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: listening(port), what="image server")
        yield port
    finally:
        server.terminate()


def download_dataset(
    env: dict[str, str], image_dir: Path, *, images: int, name: str, resolution: int,
    rows_per_shard: int,
) -> dict:  # fmt: skip
    """A dataset of the benchmark's images through `sdq download` with a CPU worker, for the
    benchmarks of the kinds that read one; not timed. Returns the download's summary."""
    home = Path(env["SDQ_HOME"])
    with image_server(image_dir, images) as port:
        worker = WorkerProcess({**env, **SERVER_ALLOWED}, home / "cpu.log", pool="cpu").start()
        try:
            listing = home / "list.parquet"
            write_list(listing, port, images)
            return sdq_json(
                env, "download", str(listing), "--dataset", name, "--resolution",
                str(resolution), "--rows-per-shard", str(rows_per_shard), "--wait",
                timeout=COMMAND_TIMEOUT,
            )  # fmt: skip
        finally:
            worker.stop()


def run_sdq(env: dict[str, str], listing: Path, name: str) -> float:
    started = time.perf_counter()
    summary = sdq_json(
        env, "download", str(listing), "--dataset", name,
        "--rows-per-shard", str(ROWS_PER_SHARD), "--wait", timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    return summary["by_status"].get("success", 0) / seconds


def run_img2dataset(command: str, listing: Path, output: Path, args) -> float:
    started = time.perf_counter()
    subprocess.run(
        [command, "--url_list", str(listing), "--input_format", "parquet",
         "--url_col", "url", "--caption_col", "caption", "--output_format", "parquet",
         "--output_folder", str(output), "--image_size", "256", "--resize_mode", "center_crop",
         "--processes_count", str(args.processes), "--thread_count", str(args.threads),
         "--number_sample_per_shard", str(ROWS_PER_SHARD), "--enable_wandb", "False"],
        env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        capture_output=True, check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    ok = sum(
        pq.read_table(path, columns=["status"]).column("status").to_pylist().count("success")
        for path in output.glob("*.parquet")
    )
    return ok / seconds


def interleaved_rounds(env: dict[str, str], port: int, args) -> dict[str, list[float]]:
    """Both tools, round after round, with one sdq CPU worker up for the whole time."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "worker", "cpu",
         "--concurrency", str(args.processes)],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    rates: dict[str, list[float]] = {"sdq": [], "img2dataset": []}
    try:
        time.sleep(5)  # the worker's processes start
        with tempfile.TemporaryDirectory() as folder:
            listing = Path(folder) / "list.parquet"
            write_list(listing, port, args.images)
            for round_ in range(args.rounds):
                rates["sdq"].append(run_sdq(env, listing, f"bench{round_}"))
                output = Path(folder) / f"img2dataset-{round_}"
                rates["img2dataset"].append(
                    run_img2dataset(args.img2dataset, listing, output, args)
                )
    finally:
        os.killpg(worker.pid, 15)
        worker.wait()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument(
        "--image-dir", type=Path, default=Path(tempfile.gettempdir()) / "sdq-bench-images"
    )
    parser.add_argument("--img2dataset", default=shutil.which("img2dataset") or "img2dataset")
    args = parser.parse_args()
    with image_server(args.image_dir, args.images) as port, deployment() as env:
        env.update(SERVER_ALLOWED, SDQ_DOWNLOAD_THREADS=str(args.threads))
        rates = interleaved_rounds(env, port, args)
    sdq, img2dataset = (statistics.median(rates[name]) for name in ("sdq", "img2dataset"))
    print(
        json.dumps(
            {
                "images": args.images,
                "processes": args.processes,
                "threads": args.threads,
                "sdq_images_per_second": round(sdq, 1),
                "img2dataset_images_per_second": round(img2dataset, 1),
                "rounds": {
                    name: [round(rate, 1) for rate in values] for name, values in rates.items()
                },
                "sdq_vs_img2dataset": round(sdq / img2dataset, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
