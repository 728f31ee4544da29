"""Prompt files: what is valid input, and how every problem in a file is reported."""

from pathlib import Path

import click
import pytest

from sdq.producer.evaluate.request import read_prompt_lines
from sdq.producer.prompts import InvalidInput, check_template, parse_size, read_prompts, read_styles
from tests.conftest import write


def list_prompts(path: Path) -> list:
    return list(read_prompts(path))


def test_quoted_commas_newlines_bom_and_crlf_are_valid(tmp_path: Path) -> None:
    text = (
        "\ufeffprompt,negative_prompt,seed,steps,guidance,width,height,n,style\r\n"
        '"a castle, at night",blurry,7,12,3.5,64,128,2,ink\r\n'
        '"two\nlines",,,,,,,,\r\n'
        "\r\n"
        "plain,,,,,,,,\r\n"
    )
    rows = list_prompts(write(tmp_path / "p.csv", text))
    assert [row.prompt for row in rows] == ["a castle, at night", "two\nlines", "plain"]
    first = rows[0]
    assert (first.negative_prompt, first.seed, first.steps, first.guidance) == (
        "blurry",
        7,
        12,
        3.5,
    )
    assert (first.width, first.height, first.n, first.style) == (64, 128, 2, "ink")
    # Line numbers are where each record starts in the file, quoted newlines included.
    assert [row.line for row in rows] == [2, 3, 6]
    assert rows[1].seed is None and rows[1].negative_prompt is None


def test_every_bad_row_is_reported_with_file_line_and_column(tmp_path: Path) -> None:
    path = write(
        tmp_path / "bad.csv",
        "prompt,seed,steps,width,height,guidance,n\n"
        "ok,1,20,64,64,7,1\n"
        ",1,20,64,64,7,1\n"
        "x,-3,20,64,64,7,1\n"
        "x,abc,0,64,64,7,1\n"
        "x,1,20,500,64,7,1\n"
        "x,1,20,64,0,nan,0\n"
        "x,1\n",
    )
    with pytest.raises(InvalidInput) as caught:
        list_prompts(path)
    found = {(error.line, error.column) for error in caught.value.errors}
    assert found == {
        (3, "prompt"),
        (4, "seed"),
        (5, "seed"),
        (5, "steps"),
        (6, "width"),
        (7, "height"),
        (7, "guidance"),
        (7, "n"),
        (8, None),
    }
    messages = [str(error) for error in caught.value.errors]
    assert f"{path}:6: width: size must be a positive multiple of 8, got 500" in messages
    assert f"{path}:3: prompt: empty prompt" in messages
    assert f"{path}:8: expected 7 fields, got 2" in messages


def test_header_problems(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as caught:
        list_prompts(write(tmp_path / "h.csv", "promt,sede,seed,seed\nx,1,2,3\n"))
    reasons = {(error.column, error.reason.split(";")[0]) for error in caught.value.errors}
    assert reasons == {
        ("promt", "unknown column (did you mean 'prompt'?)"),
        ("sede", "unknown column (did you mean 'seed'?)"),
        ("seed", "column appears more than once"),
        ("prompt", "required column is missing"),
    }
    assert all(error.line == 1 for error in caught.value.errors)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"", "empty file"), (b"prompt\n", "no prompts"), (b"prompt\ncaf\xe9\n", "not UTF-8")],
)
def test_unusable_files(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "f.csv"
    path.write_bytes(content)
    with pytest.raises(InvalidInput) as caught:
        list_prompts(path)
    assert reason in str(caught.value)
    if reason == "not UTF-8":
        assert caught.value.errors[0].line == 2


def test_styles_skip_comments_and_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "s.txt", "# styles\nink\n\n  oil paint  \n")
    assert read_styles(path) == ["ink", "oil paint"]


def test_size_and_template_checks() -> None:
    assert parse_size("512x768") == (512, 768)
    for bad in ("512", "0x512", "511x512", "axb"):
        with pytest.raises(ValueError):
            parse_size(bad)
    check_template("{prompt} by {style}", with_styles=True)
    for template, with_styles in [("{style}", True), ("{prompt}", True), ("{prompt} {x}", False)]:
        with pytest.raises(ValueError):
            check_template(template, with_styles=with_styles)


def test_renders_at_fixed_seeds_read_one_prompt_a_line_or_a_prompt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--eval-prompts` and `sdq evaluate --prompts`: one prompt a line, seeded by its line;
    a file with a prompt file's header is read as `sdq run` reads it, not as prompts named
    "prompt,seed"."""
    lines = write(tmp_path / "lines.txt", "a red circle\n\na blue square\n")
    assert read_prompt_lines(lines, "--prompts") == (("a red circle", 1), ("a blue square", 3))
    table = write(tmp_path / "prompts.csv", 'prompt,seed\n"a red circle, bright",7\nsquare,\n')
    assert read_prompt_lines(table, "--prompts") == (("a red circle, bright", 7), ("square", 3))
    # A spreadsheet's export: a byte-order mark, the columns capitalised.
    exported = write(tmp_path / "exported.csv", "\ufeffPrompt,Seed\nsquare,5\n")
    assert read_prompt_lines(exported, "--prompts") == (("square", 5),)
    bad_row = write(tmp_path / "bad.csv", "prompt,seed\nsquare,five\n")
    with pytest.raises(SystemExit) as ended:
        read_prompt_lines(bad_row, "--eval-prompts")
    assert ended.value.code == 2 and "bad.csv:2: seed" in capsys.readouterr().err
    # A prompt that names a column among its words is a prompt.
    worded = write(tmp_path / "worded.txt", "portrait, prompt, 8k\n")
    assert read_prompt_lines(worded, "--prompts") == (("portrait, prompt, 8k", 1),)
    empty = write(tmp_path / "empty.txt", "\n \n")
    with pytest.raises(click.BadParameter) as refused:
        read_prompt_lines(empty, "--eval-prompts")
    assert refused.value.format_message() == (
        f"Invalid value for --eval-prompts: {empty}: no prompts (one prompt a line)"
    )
