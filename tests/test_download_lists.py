"""Input lists: every format planned into slices the workers can read, parquet from its
metadata, s3:// in place."""

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdq.models.datasets import ImageOptions, ListColumns
from sdq.models.download.specs import SliceSpec
from sdq.models.store import LocalStore
from sdq.producer.download.lists import ListError, plan_list, slices
from sdq.workers.download.shards import read_slice
from tests.conftest import BUCKET

ROWS = [(f"http://example.com/{n}.jpg", f"caption, with comma {n}", n) for n in range(7)]
COLUMNS = ListColumns(url="url", caption="caption", save=("n",))


def write_list(path: Path) -> Path:
    if path.suffix == ".jsonl":
        lines = [json.dumps({"url": u, "caption": c, "n": n}) for u, c, n in ROWS]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".parquet":
        columns = dict(zip(["url", "caption", "n"], zip(*ROWS, strict=True), strict=True))
        pq.write_table(pa.table({k: list(v) for k, v in columns.items()}), path)
    else:
        separator = "\t" if path.suffix == ".tsv" else ","
        lines = [separator.join(["url", "caption", "n"])]
        lines += [separator.join([u, f'"{c}"', str(n)]) for u, c, n in ROWS]
        path.write_text("\n".join(lines) + "\n")
    return path


def read_all(planned, rows_per_shard: int) -> list[dict]:
    rows = []
    for number, piece in enumerate(slices(planned, rows_per_shard)):
        spec = SliceSpec(
            dataset="d",
            shard=number,
            source_uri=planned.uri,
            source_id=planned.source_id,
            first_row=piece.first_row,
            row_count=piece.row_count,
            key_digits=1,
            columns=COLUMNS,
            image=ImageOptions(),
        )
        rows += read_slice(spec).to_pylist()
    return rows


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_every_format_is_sliced_and_read_back_row_for_row(tmp_path: Path, suffix: str) -> None:
    store = LocalStore(tmp_path / "store")
    listing = write_list(tmp_path / f"list{suffix}")
    planned = plan_list(str(listing), COLUMNS, store=store, dataset="d", rows_per_shard=3)
    assert planned.rows == 7
    assert [(s.first_row, s.row_count) for s in slices(planned, 3)] == [(0, 3), (3, 3), (6, 1)]
    rows = read_all(planned, 3)
    assert [(row["url"], row["caption"], str(row["n"])) for row in rows] == [
        (u, c, str(n)) for u, c, n in ROWS
    ]
    # Planned twice, the same list is the same source: a re-run finds its shards done.
    again = plan_list(str(listing), COLUMNS, store=store, dataset="d", rows_per_shard=3)
    assert (again.uri, again.source_id) == (planned.uri, planned.source_id)


def test_an_s3_parquet_list_is_planned_from_metadata_and_read_in_place(
    s3, s3_client, tmp_path: Path
) -> None:
    buffer = io.BytesIO()
    laion = pa.table({"URL": [r[0] for r in ROWS], "TEXT": [r[1] for r in ROWS]})
    pq.write_table(laion, buffer, row_group_size=2)
    s3_client.put_object(Bucket=BUCKET, Key="lists/part-0.parquet", Body=buffer.getvalue())
    location = f"s3://{BUCKET}/lists/part-0.parquet"
    columns = ListColumns(url="URL", caption="TEXT")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in s3.items():
            patch.setenv(name, value)
        store = LocalStore(tmp_path / "store")
        planned = plan_list(location, columns, store=store, dataset="d", rows_per_shard=3)
        assert (planned.uri, planned.rows) == (location, 7)
        spec = SliceSpec(
            dataset="d", shard=1, source_uri=location, source_id=planned.source_id,
            first_row=3, row_count=3, key_digits=1, columns=columns, image=ImageOptions(),
        )  # fmt: skip
        assert read_slice(spec).column("URL").to_pylist() == [r[0] for r in ROWS[3:6]]


def test_unusable_lists_are_refused_with_the_file_named(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    header_only = pa.table({"url": pa.array([], pa.string()), "caption": pa.array([], pa.string()),
                            "n": pa.array([], pa.int64())})  # fmt: skip
    pq.write_table(header_only, tmp_path / "no-rows.parquet")
    for name, content, message in [
        ("missing.csv", None, "no such file"),
        ("list.txt", b"url\n", "expected .parquet, .csv, .tsv or .jsonl"),
        ("empty.parquet", b"", "not a readable parquet file"),
        ("garbage.parquet", b"PAR1 not really", "not a readable parquet file"),
        ("no-rows.parquet", None, "the list has no rows"),
        ("empty.csv", b"", "Empty CSV file"),
        ("header-only.csv", b"url,caption,n\n", "the list has no rows"),
        ("empty.jsonl", b"", "Empty JSON stream"),
        # A bad line is named by its number in the file, whatever block Arrow read it in.
        (
            "extra.csv",
            b'url,caption,n\nhttp://a,"x",1\n\nhttp://b,"y",2,more\n',
            "line 4: 4 fields where the header has 3 \\(url, caption, n\\)",
        ),
        (  # a byte-order mark, as spreadsheets write one, is no part of the first column's name
            "bom.csv",
            b"\xef\xbb\xbfurl,caption,n\nhttp://a,x,1,more\n",
            "line 2: 4 fields where the header has 3 \\(url, caption, n\\)",
        ),
        (
            "short.tsv",
            b"url\tcaption\tn\nhttp://a\tx\t1\nhttp://b\n",
            "line 3: 1 field where the header has 3",
        ),
        (
            "open-quote.csv",
            b'url,caption,n\nhttp://a,"two\nlines",1\nhttp://b,"open,2\nhttp://c,z,3\n',
            "line 4: a quoted field opens here and is never closed",
        ),
        (
            "broken.jsonl",
            b'{"url": "a", "caption": "b", "n": 1}\n{"url": "a", caption}\n',
            "line 2: not JSON",
        ),
        (
            "array.jsonl",
            b'{"url": "a", "caption": "b", "n": 1}\n\n[1, 2]\n',
            "line 3: a JSON array where each line holds an object",
        ),
        (
            "retyped.jsonl",
            b'{"url": null, "caption": "b"}\n{"url": "a", "caption": "b"}\n'
            b'{"url": 7, "caption": "b"}\n',
            "line 3: field 'url' is a number where line 2 has a string",
        ),
    ]:
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(ListError, match=f"{path}: ({message})"):
            plan_list(str(path), COLUMNS, store=store, dataset="d", rows_per_shard=3)
    # Nothing of them was written to the store.
    assert not list((tmp_path / "store").rglob("*"))
