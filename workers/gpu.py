"""The device a GPU worker process works on. Imports torch: GPU work only."""

import re

import torch
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from sdq.models.cores import cores
from sdq.models.specs import AUTO_DTYPE

# Loading bars are for notebooks; in a worker's log they are noise.
diffusers_logging.disable_progress_bar()
transformers_logging.disable_progress_bar()


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_cores() -> int | None:
    """The cores this process may use, where it has no GPU (None where it has): what CPU
    ranks are bounded by."""
    return None if torch.cuda.is_available() else cores()


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


# Dense bf16/fp16 tensor-core peak of one GPU, FLOP/s, by the name CUDA gives it (without
# "NVIDIA "/"Tesla "): what model FLOPs utilisation is measured against. The first pattern
# that matches the whole name wins, so a variant is listed before its family and L40 never
# passes for L4.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    (r"H100 PCIe.*", 756e12),
    (r"H100 NVL.*", 835e12),
    (r"H100\b.*", 989e12),  # SXM: "H100 80GB HBM3"
    (r"H800 PCIe.*", 756e12),
    (r"H800\b.*", 989e12),
    (r"H200 NVL.*", 835e12),
    (r"GH200\b.*", 989e12),
    (r"H200\b.*", 989e12),
    (r"B200\b.*", 2250e12),
    (r"A100\b.*", 312e12),  # "A100-SXM4-80GB", "A100 80GB PCIe"
    (r"A800\b.*", 312e12),
    (r"A10G", 125e12),
    (r"A10", 125e12),
    (r"A40", 150e12),
    (r"L40S", 362e12),
    (r"L40", 181e12),
    (r"L4", 121e12),
    (r"V100\b.*", 125e12),
)


def peak_flops_of(name: str) -> float | None:
    """A GPU's dense tensor-core peak by its CUDA name; None for one not listed."""
    model = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip())
    return next((flops for pattern, flops in PEAK_FLOPS if re.fullmatch(pattern, model)), None)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))
