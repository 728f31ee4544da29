"""The line a text list goes wrong on, found again after Arrow refused it: Arrow reads in
blocks and numbers rows within a block, so its message names no line a user can open.

Only the refused file is read this way, once, with the standard library's readers."""

import csv
import json
from collections.abc import Iterator
from pathlib import Path


def first_bad_line(source: Path, delimiter: str | None) -> str | None:
    """`line N: what is wrong there` for the first bad line of a CSV/TSV (`delimiter`) or
    JSON lines (None) file, or None where these readers find nothing wrong."""
    # utf-8-sig: a byte-order mark, as spreadsheets write one, is not part of the header.
    with source.open(newline="", encoding="utf-8-sig", errors="replace") as text:
        found = _bad_csv_row(text, delimiter) if delimiter else _bad_json_line(text)
        return next(found, None)


def _bad_csv_row(text, delimiter: str) -> Iterator[str]:
    reader = csv.reader(text, delimiter=delimiter, strict=True)
    header = next(reader, [])
    while True:
        starts_on = reader.line_num + 1  # a quoted field may run over several lines
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            unclosed = "unexpected end of data" in str(error)
            yield f"line {starts_on}: " + ("a quoted field opens here and is never closed"
                                            if unclosed else str(error))  # fmt: skip
            return
        if row and len(row) != len(header):
            fields = f"{len(row)} field{'s' if len(row) != 1 else ''}"
            yield (
                f"line {starts_on}: {fields} where the header has {len(header)}"
                f" ({', '.join(header)})"
            )
            return


def _bad_json_line(text) -> Iterator[str]:
    kinds: dict[str, tuple[str, int]] = {}  # field -> (JSON type, line it was first seen on)
    for number, line in enumerate(text, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            yield f"line {number}: not JSON ({error.msg} at column {error.colno})"
            return
        if not isinstance(row, dict):
            yield f"line {number}: a JSON {_json_type(row)} where each line holds an object"
            return
        for field, value in row.items():
            kind, first = kinds.setdefault(field, (_json_type(value), number))
            if value is not None and kind != "null" and _json_type(value) != kind:
                yield (
                    f"line {number}: field {field!r} is a {_json_type(value)}"
                    f" where line {first} has a {kind}"
                )
                return
            if kind == "null":
                kinds[field] = (_json_type(value), number)


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
