"""Command-line options built from a kind's declared run options (models/specs.py `option`):
each option's flag, type, bounds, choices, default and help come from its declaration, so a
default is written once, where the run reads it."""

import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from typing import Any, TypeVar

import click

from sdq.models.specs import Declared

F = TypeVar("F", bound=Callable[..., Any])


def declared_options(options: type, names: Iterable[str] | None = None) -> Callable[[F], F]:
    """A decorator adding the Click options of `options`' declared fields (those `names`,
    else all), in their declared order."""
    wanted = None if names is None else set(names)
    chosen = [
        declared
        for declared in fields(options)
        if "option" in declared.metadata and (wanted is None or declared.name in wanted)
    ]

    def decorate(command: F) -> F:
        for declared in reversed(chosen):  # Click lists the option applied last first
            command = _click_option(declared)(command)
        return command

    return decorate


def from_command_line(options: type, given: dict[str, Any]) -> dict[str, Any]:
    """The values given to a command, as the options' fields take them: 0 is None where the
    declaration says so."""
    taken = {}
    for declared in fields(options):
        if declared.name in given:
            value = given[declared.name]
            how = declared.metadata.get("option")
            taken[declared.name] = None if how and how.zero_is_none and not value else value
    return taken


def _click_option(declared: Field) -> Callable[[F], F]:
    how: Declared = declared.metadata["option"]
    flag = "--" + declared.name.replace("_", "-")
    kind = _base_type(declared.type)
    if kind is bool:
        return click.option(flag, is_flag=True, help=how.help)
    default = declared.default
    if how.zero_is_none:
        default = default or kind(0)
    help_text = how.help + (f" [default: {how.shown}]" if how.shown else "")
    if default is MISSING:
        # No default at all: Click (8.3 on) takes an explicit default=None as a value given,
        # and would let a required option be left out.
        return click.option(flag, type=_click_type(kind, how), required=True, help=help_text)
    return click.option(
        flag,
        type=_click_type(kind, how),
        default=default,
        show_default=default is not None,
        help=help_text,
    )


def _click_type(kind: type, how: Declared) -> Any:
    if how.choices:
        return click.Choice(how.choices)
    if kind in (int, float) and (how.low is not None or how.high is not None):
        ranged = click.IntRange if kind is int else click.FloatRange
        # 0, the "none" of a zero-is-none option, is taken where its lower bound excludes it.
        above = how.above and not how.zero_is_none
        return ranged(min=how.low, max=how.high, min_open=above, max_open=how.below)
    return kind


def _base_type(annotation: Any) -> type:
    """int for `int | None`, and so on."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation
