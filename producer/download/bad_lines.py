"""The line a text list goes wrong on, found again after Arrow refused it: Arrow reads in
blocks and numbers rows within a block, so its message names no line a user can open.

Only the refused file is read this way, once, with the standard library's readers."""

import csv
import json
from pathlib import Path
from typing import TextIO


def first_bad_line(source: Path, delimiter: str | None) -> str | None:
    """`line N: what is wrong there` for the first bad line of a CSV/TSV (`delimiter`) or
    JSON lines (None) file, or None where these readers find nothing wrong."""
    # utf-8-sig: a byte-order mark, as spreadsheets write one, is not part of the header.
    with source.open(newline="", encoding="utf-8-sig", errors="replace") as text:
        return _bad_csv_row(text, delimiter) if delimiter else _bad_json_line(text)


def _bad_csv_row(text: TextIO, delimiter: str) -> str | None:
    reader = csv.reader(text, delimiter=delimiter, strict=True)
    header = next(reader, [])
    while True:
        starts_on = reader.line_num + 1  # a quoted field may run over several lines
        try:
            row = next(reader)
        except StopIteration:
            return None
        except csv.Error as error:
            if "unexpected end of data" in str(error):
                return f"line {starts_on}: a quoted field opens here and is never closed"
            return f"line {starts_on}: {error}"
        if row and len(row) != len(header):
            fields = f"{len(row)} field{'s' if len(row) != 1 else ''}"
            header_says = f"the header has {len(header)} ({', '.join(header)})"
            return f"line {starts_on}: {fields} where {header_says}"


def _bad_json_line(text: TextIO) -> str | None:
    kinds: dict[str, tuple[str, int]] = {}  # field -> (JSON type, line it was first seen on)
    for number, line in enumerate(text, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            return f"line {number}: not JSON ({error.msg} at column {error.colno})"
        if not isinstance(row, dict):
            return f"line {number}: a JSON {_json_type(row)} where each line holds an object"
        for field, value in row.items():
            kind, first = kinds.setdefault(field, (_json_type(value), number))
            if kind == "null":  # a null says nothing of the field's type yet
                kinds[field] = (_json_type(value), number)
            elif value is not None and _json_type(value) != kind:
                return (f"line {number}: field {field!r} is a {_json_type(value)} where line "
                        f"{first} has a {kind}")  # fmt: skip
    return None


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
