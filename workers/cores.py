"""Device work takes its share of the CPU cores (models/cores.py): set where it runs."""

from sdq.models.cores import torch_threads


def share_cores() -> int:
    """Sets this process's torch threads to its share (torch_threads); returns how many."""
    import torch  # here: a CPU worker that never does device work never imports it

    threads = torch_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
