"""Reading and validating prompt files. Every problem is reported, none is fatal alone.

A problem is an `InputError` naming the file, the line and the column, so a user fixes a
whole file in one pass; nothing is submitted until the file has no problem at all. Rows
stream: a file of millions of prompts is checked and planned without being held whole.
"""

import csv
import difflib
import math
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sdq.producer.errors import InputError, InvalidInput

COLUMNS = (
    "prompt",
    "negative_prompt",
    "seed",
    "steps",
    "guidance",
    "width",
    "height",
    "n",
    "style",
)
MAX_SEED = 2**63 - 1
MAX_STEPS = 1000
MAX_SIDE = 8192
MAX_IMAGES_PER_ROW = 10_000
# Far past any useful classifier-free guidance (7.5 is usual); a bigger number is a typo.
MAX_GUIDANCE = 100.0
# Past this many problems a file is clearly not what was meant; the rest are only counted.
MAX_REPORTED_ERRORS = 1000


@dataclass(frozen=True, kw_only=True)
class PromptRow:
    line: int
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    n: int | None = None
    style: str | None = None


def text_lines(path: Path) -> Iterator[str]:
    """The file's lines as UTF-8 text (a byte-order mark is dropped); a bad byte is
    reported with its line."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                reason = f"not UTF-8 text (byte 0x{raw[error.start]:02x})"
                raise InvalidInput([InputError(str(path), number, None, reason)]) from None
            if "\x00" in text:
                # Text, not binary: Postgres could not store it, and no prompt has one.
                reason = "a NUL byte (0x00): not a text file?"
                raise InvalidInput([InputError(str(path), number, None, reason)]) from None
            yield text


def read_prompts(path: Path) -> Iterator[PromptRow]:
    """Yields the file's rows as they are checked. Problems are collected, and raised
    together as InvalidInput once the whole file has been read."""
    name = str(path)
    # Strict: a quote never closed is an error at the end of the file, instead of a last
    # prompt that has swallowed every row after it.
    reader = csv.reader(text_lines(path), strict=True)
    # 1. The header: known columns, each once, a prompt among them.
    columns = _columns(reader, name)
    # 2. Each row checked; good rows are yielded until a problem is found, then only read
    #    for their problems.
    problems = Problems(name)
    rows = 0
    for line, fields in _records(reader, problems):
        if len(fields) != len(columns):
            problems.report(
                InputError(name, line, None, f"expected {len(columns)} fields, got {len(fields)}")
            )
            continue
        row, row_errors = parse_row(name, line, dict(zip(columns, fields, strict=True)))
        problems.report(*row_errors)
        if row is not None and not problems.errors:
            rows += 1
            yield row
    # 3. Every problem at once, or a file that held no prompt.
    problems.raise_any()
    if not rows:
        raise InvalidInput([InputError(name, None, None, "no prompts: the file has only a header")])


def seeded_prompts(path: Path) -> tuple[tuple[str, int], ...]:
    """A prompt file's prompts, each with its row's seed or else its line's number: renders
    that are the same at every checkpoint (`--validation-prompts`, `--eval-prompts`)."""
    return tuple(
        (row.prompt, row.seed if row.seed is not None else row.line) for row in read_prompts(path)
    )


def is_prompt_file_header(line: str) -> bool:
    """Whether a line is a prompt file's header, as `sdq run` reads one (known columns, in
    any case, `prompt` among them), where a file of one prompt a line begins with a prompt
    ("portrait, prompt, 8k" is one)."""
    try:
        columns = {column.strip().lower() for column in next(csv.reader([line]))}
    except (csv.Error, StopIteration):
        return False
    return "prompt" in columns and columns <= set(COLUMNS)


def _columns(reader, name: str) -> list[str]:
    try:
        header = next(reader)
    except StopIteration:
        raise InvalidInput(
            [InputError(name, None, None, "empty file: a header row is required")]
        ) from None
    except csv.Error as error:
        raise InvalidInput([InputError(name, 1, None, f"malformed CSV: {error}")]) from None
    columns = [column.strip().lower() for column in header]
    if errors := _check_header(name, columns):
        raise InvalidInput(errors)
    return columns


def _records(reader, problems: "Problems") -> Iterator[tuple[int, list[str]]]:
    """The file's records that are not blank, each with the line it starts on; a record
    the CSV reader cannot read ends the file, reported."""
    start = reader.line_num + 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:
            problems.report(InputError(problems.name, start, None, _malformed(error)))
            return
        line, start = start, reader.line_num + 1
        if any(field.strip() for field in fields):
            yield line, fields


class Problems:
    """A file's problems, the first MAX_REPORTED_ERRORS of them kept, the rest counted."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors: list[InputError] = []
        self.unreported = 0

    def report(self, *problems: InputError) -> None:
        room = MAX_REPORTED_ERRORS - len(self.errors)
        self.errors.extend(problems[:room])
        self.unreported += len(problems[room:])

    def raise_any(self) -> None:
        if self.unreported:
            more = f"and {self.unreported} more problem(s)"
            self.errors.append(InputError(self.name, None, None, more))
        if self.errors:
            raise InvalidInput(self.errors)


def _malformed(error: csv.Error) -> str:
    if "unexpected end of data" in str(error):
        return "a quote opened here is never closed (a quote inside a field is written twice)"
    return f"malformed CSV: {error}"


def _did_you_mean(column: str) -> str:
    close = difflib.get_close_matches(column, COLUMNS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_header(name: str, columns: list[str]) -> list[InputError]:
    errors = [
        InputError(
            name,
            1,
            column or "(empty)",
            f"unknown column{_did_you_mean(column)}; expected some of {', '.join(COLUMNS)}",
        )
        for column in columns
        if column not in COLUMNS
    ]
    errors += [
        InputError(name, 1, column, "column appears more than once")
        for column in sorted({column for column in columns if columns.count(column) > 1})
    ]
    if "prompt" not in columns:
        errors.append(InputError(name, 1, "prompt", "required column is missing"))
    return errors


def parse_row(
    name: str, line: int, raw: dict[str, str]
) -> tuple[PromptRow | None, list[InputError]]:
    errors: list[InputError] = []
    values: dict[str, object] = {}
    prompt = raw.get("prompt", "").strip()
    if not prompt:
        errors.append(InputError(name, line, "prompt", "empty prompt"))
    for column, parse in PARSERS.items():
        text = raw.get(column, "").strip()
        if not text:
            continue
        try:
            values[column] = parse(text)
        except ValueError as error:
            errors.append(InputError(name, line, column, str(error)))
    for column in ("negative_prompt", "style"):
        text = raw.get(column, "").strip()
        if text:
            values[column] = text
    if errors:
        return None, errors
    return PromptRow(line=line, prompt=prompt, **values), []


def parse_int(text: str, *, low: int, high: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")
    return value


def parse_seed(text: str) -> int:
    return parse_int(text, low=0, high=MAX_SEED, what="seed")


def parse_steps(text: str) -> int:
    return parse_int(text, low=1, high=MAX_STEPS, what="steps")


def parse_count(text: str) -> int:
    return parse_int(text, low=1, high=MAX_IMAGES_PER_ROW, what="n")


def parse_side(text: str) -> int:
    value = parse_int(text, low=8, high=MAX_SIDE, what="size")
    if value % 8:
        raise ValueError(f"size must be a positive multiple of 8, got {value}")
    return value


def parse_guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"guidance must be a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_GUIDANCE):
        raise ValueError(f"guidance must be a number from 0 to {MAX_GUIDANCE:g}, got {text}")
    return value


def parse_size(text: str) -> tuple[int, int]:
    """`WxH`, as in `--size 512x768`."""
    width, sep, height = text.lower().partition("x")
    if not sep:
        raise ValueError(f"size must look like WIDTHxHEIGHT, got {text!r}")
    return parse_side(width), parse_side(height)


PARSERS = {
    "seed": parse_seed,
    "steps": parse_steps,
    "guidance": parse_guidance,
    "width": parse_side,
    "height": parse_side,
    "n": parse_count,
}


def read_styles(path: Path) -> list[str]:
    """One style per line; blank lines and lines starting with # are skipped."""
    lines = (line.strip() for line in text_lines(path))
    styles = [line for line in lines if line and not line.startswith("#")]
    if not styles:
        raise InvalidInput([InputError(str(path), None, None, "no styles in the file")])
    return styles


def check_template(template: str, *, with_styles: bool) -> None:
    """The prompt template may use {prompt} and {style}, and must use {prompt}."""
    try:
        fields = {
            field for _, field, _, _ in string.Formatter().parse(template) if field is not None
        }
    except ValueError as error:
        raise ValueError(f"--template {template!r}: {error}") from None
    if unknown := fields - {"prompt", "style"}:
        raise ValueError(f"--template {template!r}: unknown placeholder {{{sorted(unknown)[0]}}}")
    if "prompt" not in fields:
        raise ValueError(f"--template {template!r} must contain {{prompt}}")
    if with_styles and "style" not in fields:
        raise ValueError(f"--template {template!r} must contain {{style}} when styles are given")
