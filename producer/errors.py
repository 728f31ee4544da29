"""Errors the commands turn into a one-line message and a non-zero exit."""

from dataclasses import dataclass


class NotFound(Exception):
    """A run, job or file the user named does not exist (or has no such output)."""


@dataclass(frozen=True)
class InputError:
    file: str
    line: int | None
    column: str | None
    reason: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return (
            f"{where}: {self.column}: {self.reason}" if self.column else f"{where}: {self.reason}"
        )


class InvalidInput(Exception):
    def __init__(self, errors: list[InputError]) -> None:
        super().__init__("\n".join(map(str, errors)))
        self.errors = errors
