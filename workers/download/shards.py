"""Parquet in and out: one slice of an input list read by its row groups, one shard
written in img2dataset's columns."""

import io
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from sdq.models.download.specs import SliceSpec


def open_list(uri: str) -> pq.ParquetFile:
    """A parquet list by URI: file:// or s3:// (endpoint and keys as boto3 reads them)."""
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    return pq.ParquetFile(filesystem.open_input_file(path))


def read_slice(spec: SliceSpec) -> pa.Table:
    """The slice's rows and only the columns it needs, reading only the row groups that
    hold them (a LAION part of a million rows is not read whole for 1000)."""
    source = open_list(spec.source_uri)
    stop = spec.first_row + spec.row_count
    groups, group_start, first_group_start = [], 0, None
    for index in range(source.num_row_groups):
        rows = source.metadata.row_group(index).num_rows
        if group_start < stop and group_start + rows > spec.first_row:
            groups.append(index)
            first_group_start = group_start if first_group_start is None else first_group_start
        group_start += rows
    table = source.read_row_groups(groups, columns=spec.columns.all)
    return table.slice(spec.first_row - (first_group_start or 0), spec.row_count)


@dataclass
class ShardRow:
    """One sample as the shard and the samples table both hold it."""

    key: str
    url: str
    caption: str | None
    status: str | None = None  # None until decided
    error_message: str | None = None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    sha256: str | None = None
    image: bytes | None = None


SHARD_COLUMNS = [
    pa.field("key", pa.string()),
    pa.field("url", pa.string()),
    pa.field("caption", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
    pa.field("sha256", pa.string()),
]


def shard_bytes(rows: list[ShardRow], image_format: str, saved: pa.Table) -> bytes:
    """The shard file: img2dataset's columns, the image bytes in a column named after the
    format (`jpg`, `webp`, `png`), then the saved columns of the list as they were."""
    columns: dict[str, Any] = {
        field.name: pa.array([getattr(row, field.name) for row in rows], field.type)
        for field in SHARD_COLUMNS
    }
    columns[image_format] = pa.array([row.image for row in rows], pa.binary())
    for name in saved.column_names:
        columns.setdefault(name, saved.column(name))
    # Encoded images do not compress further; the text columns do.
    compression = {name: "none" if name == image_format else "zstd" for name in columns}
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer, compression=compression)
    return buffer.getvalue()


def read_shard_rows(data: bytes, image_format: str) -> dict[str, ShardRow]:
    """A shard file's rows by key, images included: what a retry keeps as it was."""
    table = pq.read_table(
        io.BytesIO(data), columns=[field.name for field in SHARD_COLUMNS] + [image_format]
    )
    rows = {}
    for record in table.to_pylist():
        image = record.pop(image_format)
        rows[record["key"]] = ShardRow(**record, image=image)
    return rows
