"""Ruff is part of the test command: style problems fail the build like any other."""

import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_check_and_format() -> None:
    for command in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
