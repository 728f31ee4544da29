"""Task messages are checked before a worker takes them in: anyone who can reach the broker
can put anything on a queue, and Celery's consumer stops the whole worker on a message
of the wrong shape (a `timelimit` header that is not two numbers, a body that is not
three parts), so the supervisor starts it again on the same message, for ever. A message
whose headers Celery reads as numbers or dates are not such, whose body is not
`[args, {options}, embed]` binding the task's own arguments, or whose job ids are not
whole numbers, is logged once with its id and the reason and rejected without being
requeued; the worker goes on. Every task of the app is checked: `CheckedTask` is the
app's task class."""

import inspect
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Any, get_args, get_type_hints

from celery import Task
from celery.exceptions import InvalidTaskError
from celery.utils.time import maybe_iso8601
from celery.worker.strategy import default as default_strategy

# More job ids than any run puts in one message (see Run.jobs_per_message).
MAX_JOB_IDS = 10_000


class CheckedTask(Task):
    """The base of every sdq task: its messages are checked before a worker takes them in."""

    Strategy = "sdq.workers.messages:checked_strategy"


def checked_strategy(task: Task, app: Any, consumer: Any, **options: Any) -> Callable:
    """Celery's default strategy, behind `check_message`; an InvalidTaskError raised here
    is logged and the message rejected by the consumer itself."""
    handle = default_strategy(task, app, consumer, **options)

    def handle_checked(message, body, ack, reject, callbacks, **more):
        headers = message.headers or {}
        try:
            check_headers(task, headers)
            check_message(task, _decoded(task, message) if body is None else body)
        except InvalidTaskError as error:
            # The log line says which message: its id, as the sender and Flower know it.
            raise InvalidTaskError(f"{error} (message {headers.get('id')!r})") from None
        return handle(message, body, ack, reject, callbacks, **more)

    return handle_checked


def _decoded(task: Task, message: Any) -> Any:
    try:
        return message.decode()
    except Exception as error:  # kombu raises whatever the serializer raised
        raise InvalidTaskError(f"{task.name}: the body does not decode ({error})") from None


def check_headers(task: Task, headers: dict[str, Any]) -> None:
    """The headers Celery's worker uses as numbers, dates and names are such."""
    timelimit = headers.get("timelimit")
    if timelimit is not None and not (
        isinstance(timelimit, list | tuple)
        and len(timelimit) == 2
        and all(limit is None or (_is_number(limit) and limit > 0) for limit in timelimit)
    ):
        raise InvalidTaskError(f"{task.name}: timelimit={timelimit!r} is not [hard, soft] seconds")
    retries = headers.get("retries", 0)
    if type(retries) is not int or retries < 0:
        raise InvalidTaskError(f"{task.name}: retries={retries!r} is not a count")
    for name in ("eta", "expires"):
        if headers.get(name) is not None:
            _check_date(task, name, headers[name])
    if not isinstance(headers.get("id"), str):
        raise InvalidTaskError(f"{task.name}: the message has no id")
    for name in ("root_id", "parent_id", "group"):
        if not isinstance(headers.get(name), str | NoneType):
            raise InvalidTaskError(f"{task.name}: {name}={headers[name]!r} is not a string")


def _check_date(task: Task, name: str, value: Any) -> None:
    try:
        maybe_iso8601(value)
    except (TypeError, ValueError):
        raise InvalidTaskError(f"{task.name}: {name}={value!r} is not a date") from None


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def check_message(task: Task, body: Any) -> None:
    if not (isinstance(body, list | tuple) and len(body) == 3):
        raise InvalidTaskError(f"{task.name}: the body is not [args, kwargs, embed]")
    args, kwargs, _ = body
    if not (isinstance(args, list | tuple) and isinstance(kwargs, dict)):
        raise InvalidTaskError(f"{task.name}: args must be a list and kwargs an object")
    try:
        bound = inspect.signature(task.run).bind(*args, **kwargs).arguments
    except TypeError as error:
        raise InvalidTaskError(f"{task.name}: {error}") from None
    if "job_ids" in bound:
        _check_job_ids(task, bound.pop("job_ids"))
    hints = get_type_hints(task.run)
    for name, value in bound.items():
        if not _is_a(value, hints[name]):
            raise InvalidTaskError(f"{task.name}: {name}={value!r} is not {hints[name]}")


def _check_job_ids(task: Task, job_ids: Any) -> None:
    most = getattr(task, "max_job_ids", MAX_JOB_IDS)
    if not (
        isinstance(job_ids, list)
        and 0 < len(job_ids) <= most
        and all(type(job_id) is int and job_id > 0 for job_id in job_ids)
    ):
        raise InvalidTaskError(
            f"{task.name}: job_ids must be a list of 1 to {most} positive job ids"
        )


def _is_a(value: Any, hint: Any) -> bool:
    """For the plain option types tasks take: int, float, str, and unions of them with
    None. A bool is not taken for a number."""
    kinds = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    return any(value is None if kind is NoneType else type(value) is kind for kind in kinds)
