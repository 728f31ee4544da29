"""A GPU that fails every call with "CUDA out of memory", for the worker processes started
with this folder first on PYTHONPATH and SDQ_TEST_SICK_DEVICE=1: rendering raises what
torch raises when a device runs out of memory."""

import os

if os.environ.get("SDQ_TEST_SICK_DEVICE") == "1":
    import torch

    from sdq.workers.generate import pipelines

    def _render_on_a_sick_device(loaded, specs, **_):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pipelines.render = _render_on_a_sick_device
