"""Runs `sdq download` over every hostile case, embedded (SQLite, a local folder, the work
in-process), and prints what SQL and the shard say of each row as JSON.

Meant to run inside a network namespace that has only loopback (`unshare -n`), so that a
broken address check fails the test instead of sending a packet off the machine:

    unshare -n sh -c 'ip link set lo up && python -m tests.netns_download FOLDER'
"""

import csv
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tests.hostile_server import CASES, OFF_MACHINE_CASES, HostileServer, case_rows

# What the hostile cases need: loopback's 127.0.0.1 allowed (the server), 127.0.0.2 not; a
# read timeout under the slow server's trickle; one retry for the flaky one.
DOWNLOAD_ENV = {
    "SDQ_DOWNLOAD_ALLOW_NETWORKS": "127.0.0.1/32",
    "SDQ_DOWNLOAD_TIMEOUT": "1",
    "SDQ_DOWNLOAD_CONNECT_TIMEOUT": "1",
    "SDQ_DOWNLOAD_RETRIES": "1",
    "SDQ_DOWNLOAD_MAX_BYTES": "600000",
}


def write_list(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["url", "caption"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def main(folder: Path) -> None:
    with HostileServer() as server:
        rows = case_rows(server.base, server.port, CASES + OFF_MACHINE_CASES)
        write_list(folder / "list.csv", rows)
        env = {
            key: value for key, value in os.environ.items() if not key.startswith(("SDQ_", "AWS_"))
        }
        env.update(DOWNLOAD_ENV, SDQ_HOME=str(folder / "home"))
        subprocess.run(
            [sys.executable, "-m", "sdq.producer.cli", "download", str(folder / "list.csv"),
             "--dataset", "hostile", "--rows-per-shard", "100", "--json"],
            env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    with sqlite3.connect(folder / "home" / "sdq.db") as db:
        sql = [
            dict(zip(("key", "url", "status", "reason"), row, strict=True))
            for row in db.execute("SELECT key, url, status, reason FROM samples ORDER BY key")
        ]
    shard = pq.read_table(folder / "home/store/datasets/hostile/images/00000.parquet")
    images = shard.column("jpg").to_pylist()
    shard_rows = [
        {**row, "has_image": image is not None}
        for row, image in zip(shard.drop_columns("jpg").to_pylist(), images, strict=True)
    ]
    print(json.dumps({"expected": rows, "sql": sql, "shard": shard_rows}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
