"""The device a GPU worker process works on. Imports torch: GPU work only."""

import torch
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from sdq.models.specs import AUTO_DTYPE

# Loading bars are for notebooks; in a worker's log they are noise.
diffusers_logging.disable_progress_bar()
transformers_logging.disable_progress_bar()


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str) -> torch.dtype:
    """A spec's dtype on this process's device; "auto" is float16 on a GPU, float32 on the
    CPU. An explicit dtype is honoured as it is."""
    if name == AUTO_DTYPE:
        return torch.float16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def describe_device() -> str:
    """What the job history records: the GPU's model and its UUID, which names the physical
    card whatever CUDA_VISIBLE_DEVICES numbered it."""
    if not torch.cuda.is_available():
        return "cpu"
    properties = torch.cuda.get_device_properties(0)
    return f"cuda {properties.name} GPU-{properties.uuid}"
