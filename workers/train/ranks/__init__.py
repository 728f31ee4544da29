"""A train run's rank processes and what a worker keeps of a run between its jobs: the
processes of one node (processes.py), forked from the worker's rank fork server
(server.py), what each of them runs (serve.py), and the run held in the worker itself
(live.py)."""
