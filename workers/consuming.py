"""Which queues this worker consumes: its selection (`--queues`, else every queue), with
those a warming worker holds back until its pool is warm (workers/main.py) counted in."""

from celery import Celery

# Set in a warming worker's main process before its pool forks; its processes inherit it.
held_back: list[str] = []


def consumed(app: Celery) -> set[str]:
    return set(app.amqp.queues.consume_from or app.amqp.queues) | set(held_back)
