"""Requests that arrive together for the same pipeline call's settings (model, size, steps,
guidance, sampler: their batch key) go to the workers as one message when they arrive
within SDQ_SERVE_BATCH_WINDOW_MS: one pipeline call renders them, as a batch run's would.
A group is sent when its window ends, or at once when it fills a call (SDQ_BATCH_SIZE); a
request with a call's worth of images of its own is sent by itself."""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# Sends a group: (run ids, job ids) -> once the broker has them.
SendTogether = Callable[[list[int], list[int]], Awaitable[None]]


@dataclass
class _Group:
    sent: asyncio.Future
    run_ids: list[int] = field(default_factory=list)
    job_ids: list[int] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class Coalescer:
    def __init__(self, send_together: SendTogether, *, window: float, call_size: int) -> None:
        self._send_together, self._window, self._call_size = send_together, window, call_size
        self._groups: dict[str, _Group] = {}

    def takes(self, images: int) -> bool:
        """Whether a request of this many images waits for others (else it goes alone)."""
        return self._window > 0 and images < self._call_size

    async def send(self, batch_key: str, run_id: int, job_ids: list[int]) -> None:
        """Joins the group of `batch_key`, and returns once the group is sent (or raises
        what sending it raised)."""
        group = self._groups.get(batch_key)
        if group is not None and len(group.job_ids) + len(job_ids) > self._call_size:
            self._flush(batch_key)  # no room in this call: the next call's group begins
            group = None
        if group is None:
            group = self._groups[batch_key] = _Group(asyncio.get_running_loop().create_future())
            group.timer = asyncio.get_running_loop().call_later(
                self._window, self._flush, batch_key
            )
        group.run_ids.append(run_id)
        group.job_ids.extend(job_ids)
        sent = group.sent
        if len(group.job_ids) == self._call_size:
            self._flush(batch_key)
        await asyncio.shield(sent)  # a client gone does not stop the others' send

    def _flush(self, batch_key: str) -> None:
        group = self._groups.pop(batch_key, None)
        if group is None:
            return
        if group.timer is not None:
            group.timer.cancel()
        task = asyncio.get_running_loop().create_task(
            self._send_together(group.run_ids, group.job_ids)
        )
        task.add_done_callback(lambda done: _settle(group.sent, done))


def _settle(sent: asyncio.Future, done: asyncio.Task) -> None:
    if done.exception() is not None:
        sent.set_exception(done.exception())
    else:
        sent.set_result(None)
