"""Input lists: parquet, CSV, TSV or JSON lines, local or s3://, made readable by every
worker and cut into slices.

A parquet list is planned from its metadata alone: row counts, not rows. An s3:// one is
read in place by the workers; a local one is copied into the store as it is. A text list
has no row index, so it is read once and written to the store as parquet (only the
columns a shard needs, one row group per slice), which the workers then read by slice.
"""

import difflib
import hashlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.fs
import pyarrow.json
import pyarrow.parquet as pq

from sdq.models.datasets import ListColumns
from sdq.models.registry import file_sha256
from sdq.models.store import ObjectStore
from sdq.producer.download.bad_lines import first_bad_line

DELIMITERS = {".csv": ",", ".tsv": "\t"}
JSON_LINES = (".jsonl", ".json", ".ndjson")


class ListError(Exception):
    """A list that cannot be used, with the file named."""


@dataclass(frozen=True)
class PlannedList:
    location: str  # as the user gave it
    uri: str  # as the workers read it
    source_id: str  # what it held: its content hash, or for s3:// its size and time
    rows: int


@dataclass(frozen=True)
class Slice:
    source: PlannedList
    first_row: int
    row_count: int


def slices(planned: PlannedList, rows_per_shard: int) -> Iterator[Slice]:
    for first in range(0, planned.rows, rows_per_shard):
        yield Slice(planned, first, min(rows_per_shard, planned.rows - first))


def plan_list(
    location: str, columns: ListColumns, *, store: ObjectStore, dataset: str, rows_per_shard: int
) -> PlannedList:
    suffix = Path(location).suffix.lower()
    if location.startswith("s3://"):
        if suffix != ".parquet":
            raise ListError(f"{location}: s3:// lists are read in place and must be parquet")
        return _s3_parquet(location, columns)
    path = Path(location)
    if not path.is_file():
        raise ListError(f"{location}: no such file")
    if suffix == ".parquet":
        metadata = _parquet_metadata(location, path)
        _check_columns(location, metadata.schema.names, columns)
        return _stored(location, path, _rows(location, metadata.num_rows), store, dataset)
    if suffix not in DELIMITERS and suffix not in JSON_LINES:
        raise ListError(f"{location}: expected .parquet, .csv, .tsv or .jsonl")
    with tempfile.TemporaryDirectory() as folder:
        converted = Path(folder) / "list.parquet"
        rows = _rows(location, _text_to_parquet(path, converted, columns, rows_per_shard))
        return _stored(location, converted, rows, store, dataset)


def _parquet_metadata(location: str, path: Path) -> pq.FileMetaData:
    try:
        return pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException) as error:
        raise ListError(f"{location}: not a readable parquet file ({error})") from None


def _rows(location: str, rows: int) -> int:
    if rows == 0:
        raise ListError(f"{location}: the list has no rows")
    return rows


def _s3_parquet(location: str, columns: ListColumns) -> PlannedList:
    try:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(location)
        info = filesystem.get_file_info(path)
        if info.type != pyarrow.fs.FileType.File:
            raise ListError(f"{location}: no such object")
        metadata = pq.ParquetFile(filesystem.open_input_file(path)).metadata
    except (OSError, pa.ArrowException) as error:
        raise ListError(f"{location}: {error}") from None
    _check_columns(location, metadata.schema.names, columns)
    identity = f"{location}|{info.size}|{info.mtime_ns}"
    return PlannedList(
        location, location, _sha256(identity.encode()), _rows(location, metadata.num_rows)
    )


def _stored(location: str, path: Path, rows: int, store: ObjectStore, dataset: str) -> PlannedList:
    """Puts the file in the store under its content hash, once: planning the same list
    again finds it there."""
    digest = file_sha256(path)
    key = f"datasets/{dataset}/lists/{digest[:32]}.parquet"
    if not store.exists(key):
        store.put_file(key, path)
    return PlannedList(location, store.uri(key), digest, rows)


def _text_to_parquet(source: Path, target: Path, columns: ListColumns, group_rows: int) -> int:
    """Streams the text list into parquet a block at a time: memory stays flat however long
    the list; every kept column is read as text, as it was written."""
    try:
        names = _open_text(source, None).schema.names
        _check_columns(str(source), names, columns)
        reader = _open_text(source, columns.all)
        rows = 0
        with pq.ParquetWriter(target, _text_schema(columns.all)) as writer:
            for batch in reader:
                table = pa.Table.from_batches([batch]).select(columns.all)
                writer.write_table(table.cast(_text_schema(columns.all)), group_rows)
                rows += batch.num_rows
        return rows
    except (OSError, UnicodeDecodeError, pa.ArrowException) as error:
        where = first_bad_line(source, DELIMITERS.get(source.suffix.lower()))
        raise ListError(f"{source}: {where or error}") from None


def _open_text(source: Path, keep: list[str] | None):
    suffix = source.suffix.lower()
    if suffix in JSON_LINES:
        return pyarrow.json.open_json(source)
    parse = pyarrow.csv.ParseOptions(delimiter=DELIMITERS[suffix], newlines_in_values=True)
    convert = pyarrow.csv.ConvertOptions(
        include_columns=keep, column_types=dict.fromkeys(keep or [], pa.string())
    )
    return pyarrow.csv.open_csv(source, parse_options=parse, convert_options=convert)


def _text_schema(names: list[str]) -> pa.Schema:
    return pa.schema([pa.field(name, pa.string()) for name in names])


def _check_columns(location: str, names: list[str], columns: ListColumns) -> None:
    for wanted in columns.all:
        if wanted not in names:
            by_lower = {name.lower(): name for name in names}
            close = difflib.get_close_matches(wanted.lower(), list(by_lower), n=1)
            hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
            raise ListError(f"{location}: no column {wanted!r} (it has {', '.join(names)}){hint}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
