"""Task messages are checked before a worker takes them in: anyone who can reach the broker
can put anything on a queue, and Celery's consumer stops the whole worker on a message
body of the wrong shape. A message that is not `[[job_ids], {options}, embed]`, with job
ids that are whole numbers and options the task takes, is logged once with its id and
the reason and rejected without being requeued; the worker goes on."""

import inspect
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Any, get_args, get_type_hints

from celery import Task
from celery.exceptions import InvalidTaskError
from celery.worker.strategy import default as default_strategy

# More job ids than any run puts in one message (see Run.jobs_per_message).
MAX_JOB_IDS = 10_000


def checked_strategy(task: Task, app: Any, consumer: Any, **options: Any) -> Callable:
    """Celery's default strategy, behind `check_message`; an InvalidTaskError raised here
    is logged and the message rejected by the consumer itself."""
    handle = default_strategy(task, app, consumer, **options)

    def handle_checked(message, body, ack, reject, callbacks, **more):
        check_message(task, message.decode() if body is None else body)
        return handle(message, body, ack, reject, callbacks, **more)

    return handle_checked


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
    job_ids = bound.pop("job_ids")
    if not (
        isinstance(job_ids, list)
        and 0 < len(job_ids) <= MAX_JOB_IDS
        and all(type(job_id) is int and job_id > 0 for job_id in job_ids)
    ):
        raise InvalidTaskError(f"{task.name}: job_ids must be a list of positive job ids")
    hints = get_type_hints(task.run)
    for name, value in bound.items():
        if not _is_a(value, hints[name]):
            raise InvalidTaskError(f"{task.name}: {name}={value!r} is not {hints[name]}")


def _is_a(value: Any, hint: Any) -> bool:
    """For the plain option types tasks take: int, float, str, and unions of them with
    None. A bool is not taken for a number."""
    kinds = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    return any(value is None if kind is NoneType else type(value) is kind for kind in kinds)
