"""`sdq export`: a generation run's images and what made each of them, for tools that do
not speak SQL: a folder (PNGs and metadata.csv), one parquet file (metadata and the PNG
bytes), or WebDataset tar shards (`<key>.png` beside `<key>.json`)."""

import csv
import io
import json
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sdq.models.generate.specs import image_key
from sdq.models.store import ObjectStore, atomic_file

FORMATS = ("folder", "parquet", "webdataset")
# Samples per WebDataset shard: big enough to stream well, small enough to shuffle.
SAMPLES_PER_TAR = 1000

Images = Iterator[tuple[dict[str, Any], bytes]]


def export_run(
    rows: list[dict[str, Any]], store: ObjectStore, folder: Path, *, run_id: int, format: str
) -> list[Path]:
    """Writes the run's images and metadata under `folder`; returns the files written.
    Every file is written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    images = ((row, store.get_bytes(image_key(row["spec_hash"]))) for row in rows)
    write: Callable[[Images, Path, int], list[Path]] = WRITERS[format]
    return write(images, folder, run_id)


def _folder(images: Images, folder: Path, run_id: int) -> list[Path]:
    written, rows = [], []
    for row, data in images:
        path = folder / "images" / row["file_name"]
        with atomic_file(path) as handle:
            handle.write(data)
        written.append(path)
        rows.append({**row, "file_name": f"images/{row['file_name']}"})
    table = folder / "metadata.csv"
    with atomic_file(table) as handle:
        text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
        writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["file_name"])
        writer.writeheader()
        writer.writerows(rows)
        text.detach()  # the handle stays open for atomic_file to close
    return [table, *written]


def _parquet(images: Images, folder: Path, run_id: int) -> list[Path]:
    # pyarrow (with numpy) is a tenth of a second of every command's start: loaded here only.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**row, "png": data} for row, data in images]
    path = folder / f"run-{run_id}.parquet"
    with atomic_file(path) as handle:
        pq.write_table(pa.Table.from_pylist(rows), handle)
    return [path]


def _webdataset(images: Images, folder: Path, run_id: int) -> list[Path]:
    written: list[Path] = []
    batch: list[tuple[dict[str, Any], bytes]] = []
    for item in images:
        batch.append(item)
        if len(batch) == SAMPLES_PER_TAR:
            written.append(_tar(batch, folder / f"run-{run_id}-{len(written):06d}.tar"))
            batch = []
    if batch or not written:
        written.append(_tar(batch, folder / f"run-{run_id}-{len(written):06d}.tar"))
    return written


def _tar(batch: list[tuple[dict[str, Any], bytes]], path: Path) -> Path:
    with atomic_file(path) as handle, tarfile.open(fileobj=handle, mode="w") as tar:
        for row, data in batch:
            key = row["spec_hash"]
            for name, content in ((f"{key}.png", data), (f"{key}.json", _json(row))):
                info = tarfile.TarInfo(name)
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return path


def _json(row: dict[str, Any]) -> bytes:
    return json.dumps(row, ensure_ascii=False, sort_keys=True).encode()


WRITERS = {"folder": _folder, "parquet": _parquet, "webdataset": _webdataset}
