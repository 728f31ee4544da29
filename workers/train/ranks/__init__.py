"""A train run's rank processes and what a worker keeps of a run between its jobs: the
processes of one node (processes.py), what each of them runs (serve.py, started as
`python -m sdq.workers.train.ranks`), and the run held in the worker itself (live.py)."""
