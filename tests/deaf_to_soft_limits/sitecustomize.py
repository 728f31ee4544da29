"""Pool processes that do not hear Celery's soft time limit, as a process stuck in a C
call or the kernel does not, for the workers started with this folder first on PYTHONPATH
and SDQ_TEST_DEAF_TO_SOFT_LIMITS=1: only the hard limit stops their tasks, by killing the
process."""

import os

if os.environ.get("SDQ_TEST_DEAF_TO_SOFT_LIMITS") == "1":
    import billiard.pool

    # The handler each pool process installs for the soft limit's signal, looked up then.
    billiard.pool.soft_timeout_sighandler = lambda signum, frame: None
