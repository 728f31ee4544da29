"""The generic job layer, shared by the producer and the workers of every kind of work.

- kinds: the table of kinds (name, queue, pool, task) and the queues of each pool;
- lifecycle: the status transitions, each a conditional UPDATE plus history rows;
- outbox: sending a run's jobs after they are committed, and sending them again;
- delivery: the skeleton every worker runs (claim, reuse, keep leases, fail, succeed)
  around one kind's work.
"""
