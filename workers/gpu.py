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


def release_device_memory() -> None:
    """Hands the memory of tensors just let go back to the GPU, for other models to load."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


# Dense bf16/fp16 tensor-core peak of one GPU, FLOP/s, by what CUDA calls it (the longest name
# that matches wins): what model FLOPs utilisation is measured against.
PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = [key for key in PEAK_FLOPS if key in name]
    return PEAK_FLOPS[max(known, key=len)] if known else None
