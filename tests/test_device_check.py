"""benchmarks/device_check.py as a CPU runs it (--small, tiny shapes): each measurement's
line comes the moment it is measured, every line is JSON, and every part is measured; a
budget too small for a part skips it, saying why, and the check ends within the budget."""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT

CHECK = ROOT / "benchmarks/device_check.py"
PARTS = {"train", "generate", "encode", "curate"}


def run_check(log: Path, *args: str) -> tuple[list[tuple[float, dict]], float]:
    """The check's lines as they come, each with the second it came, and the check's wall
    time."""
    started = time.monotonic()
    with log.open("w") as errors:
        process = subprocess.Popen(
            [sys.executable, str(CHECK), "--small", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True,
        )  # fmt: skip
        lines = []
        for raw in process.stdout:
            try:
                lines.append((time.monotonic() - started, json.loads(raw)))
            except ValueError:
                raise AssertionError(f"not a JSON line: {raw!r}") from None
        process.wait(timeout=60)
    seconds = time.monotonic() - started
    assert process.returncode == 0, log.read_text()[-3000:]
    return lines, seconds


def test_lines_come_as_each_measurement_ends(tmp_path: Path) -> None:
    # Two checks at once, training in one and the other parts in the other: training's plain
    # side spends its time starting torchrun and importing, which the other check overlaps.
    groups = {"train": "eager", "generate,encode,curate": "eager,resolutions"}
    with ThreadPoolExecutor(len(groups)) as checks:
        runs = list(checks.map(lambda parts: run_check(
            tmp_path / f"{parts}.log", "--parts", parts, "--measures", groups[parts],
            "--budget-s", "300",
        ), groups))  # fmt: skip
    measured, resolutions = [], []
    for lines, _ in runs:
        first, summary = lines[0][1], lines[-1][1]
        assert {"device", "torch", "budget_s"} <= set(first)
        assert summary["summary"] and not summary["skipped"] and not summary["failed"], summary
        assert summary["seconds"] <= 300
        ours = [(came, line) for came, line in lines if "sdq_vs_plain" in line]
        assert ours, lines
        # Each measurement came as it was done, not all at the end: from the first's line to
        # the summary's, at least the time the later ones took.
        later = sum(line["seconds"] for _, line in ours[1:])
        assert lines[-1][0] - ours[0][0] >= later - 0.2, lines
        measured += [line for _, line in ours]
        resolutions += [line for _, line in lines if line.get("measure") == "resolutions"]
        # Training's sdq side is out before its plain side starts (a plain side cut off by
        # the budget loses nothing of sdq's).
        trained = [came for came, line in ours if line["part"] == "train"]
        sdq_first = [came for came, line in lines if line.get("side") == "sdq"]
        assert len(sdq_first) == len(trained), lines
        assert all(first < came for first, came in zip(sdq_first, trained, strict=True)), lines
    assert {line["part"] for line in measured} == PARTS, measured
    assert len(measured) >= len(PARTS) + 1  # generate measures two batch sizes
    for line in measured:
        unit = "images" if line["part"] == "generate" else "samples"
        assert line[f"sdq_{unit}_per_s"] > 0 and line[f"plain_{unit}_per_s"] > 0, line
        assert line["sdq_vs_plain"] > 0 and line["seconds"] >= 0, line
    # Encode's one pass at two resolutions against a pass at each (benchmarks/encode.py's
    # one_pass_over_two, with no services): both sides timed, their ratio given.
    [both] = resolutions
    assert both["resolutions"] == "64,128" and both["one_pass_images_per_s"] > 0, both
    speeds = both["one_pass_images_per_s"] / both["a_pass_each_images_per_s"]
    assert both["one_pass_over_two"] == pytest.approx(speeds, rel=0.01), both
    # Generation's eager lines measure the worker both ways (SDQ_CHANNELS_LAST).
    for line in measured:
        if line["part"] == "generate":
            assert line["sdq_channels_last_images_per_s"] > 0, line
            assert line["channels_last_over_contiguous"] > 0, line


def test_a_part_that_would_not_fit_is_skipped_and_the_budget_kept(tmp_path: Path) -> None:
    # Training at --small takes tens of seconds on 2 cores (its plain side starts torchrun).
    budget = 20
    lines, seconds = run_check(
        tmp_path / "stderr.log", "--parts", "train", "--budget-s", str(budget)
    )
    skipped = [line for _, line in lines if "part" in line and "skipped" in line]
    assert [(line["part"], line["measure"]) for line in skipped] == [
        ("train", "eager"),
        ("train", "compiled"),
    ], lines
    assert all(line["skipped"].startswith("would take ~") for line in skipped), skipped
    summary = lines[-1][1]
    assert summary["summary"] and summary["seconds"] <= budget, summary
    assert summary["skipped"] == ["train eager", "train compiled"], summary
    # Its own count starts after Python does: the wall time adds the interpreter's start.
    assert seconds <= budget + 10, seconds
