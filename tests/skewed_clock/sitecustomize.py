"""A machine whose clock is off by SDQ_TEST_CLOCK_SKEW seconds, for the Python processes
started with this folder first on PYTHONPATH (a worker, and every process it starts):
time.time() and datetime.now()/utcnow() read the skewed wall clock, as they would on such a
machine; the monotonic clock runs true, as it does there."""

import datetime
import os
import time

SKEW = float(os.environ.get("SDQ_TEST_CLOCK_SKEW", "0"))
_true_time = time.time


class _SkewedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().now(tz) + datetime.timedelta(seconds=SKEW)

    @classmethod
    def utcnow(cls):
        return super().utcnow() + datetime.timedelta(seconds=SKEW)


def _skewed_time() -> float:
    return _true_time() + SKEW


if SKEW:
    datetime.datetime = _SkewedDatetime
    time.time = _skewed_time
