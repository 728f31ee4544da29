"""One rank's training loop, the same in a worker that trains alone and in every rank
process: the state (state.py) built around a U-Net (build.py), one optimizer step on its
inputs (step.py) read in a seeded order (data.py), the steps a job takes (training.py), and
its checkpoints (checkpoints.py, files.py; sharding.py when the state is spread over the
ranks). GPU-side: everything but data.py imports torch."""
