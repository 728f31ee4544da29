"""What a worker's processes hold in memory, answered over Celery's remote control, so that
`sdq metrics` can show it per worker at each scrape (seed 002's per-GPU view).

The answer comes from the worker's main process, which never touches CUDA (its pool's
children do the work): resident memory of the whole process tree from psutil, and the
device memory those processes use on each GPU, and its utilisation, temperature and power,
from NVML, which reads the driver without making a CUDA context. Without a GPU, or without
NVML, there are no GPU figures.
"""

import os
from collections.abc import Callable
from typing import Any

import psutil
from celery.worker.control import inspect_command

DEVICE_MEMORY_COMMAND = "device_memory"


@inspect_command(name=DEVICE_MEMORY_COMMAND)
def device_memory(state) -> dict[str, Any]:
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    return {
        "rss_bytes": sum(_rss(process) for process in processes),
        "gpus": gpu_memory({process.pid for process in processes}),
    }


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:  # a pool child that just exited
        return 0


def gpu_memory(pids: set[int]) -> list[dict[str, Any]]:
    """Per GPU this worker may use: its name, the bytes these processes hold on it, and
    the bytes in use and in all on the device."""
    try:
        import pynvml
    except ImportError:  # a CPU-only install
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver: a machine without a GPU
        return []
    try:
        return [_describe(pynvml, handle, pids) for handle in _visible(pynvml)]
    finally:
        pynvml.nvmlShutdown()


def _visible(pynvml) -> list[Any]:
    """The GPUs CUDA_VISIBLE_DEVICES lets this worker see (indices or UUIDs), else all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    return [
        pynvml.nvmlDeviceGetHandleByUUID(name) if name.startswith("GPU-")
        else pynvml.nvmlDeviceGetHandleByIndex(int(name))
        for name in (part.strip() for part in visible.split(","))
        if name
    ]  # fmt: skip


def _describe(pynvml, handle, pids: set[int]) -> dict[str, Any]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    ours = sum(
        process.usedGpuMemory or 0
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if process.pid in pids
    )
    return {
        "gpu": pynvml.nvmlDeviceGetUUID(handle),
        "name": pynvml.nvmlDeviceGetName(handle),
        "used_by_worker_bytes": ours,
        "used_bytes": memory.used,
        "total_bytes": memory.total,
        "utilization_percent": _reading(
            pynvml, lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        ),
        "temperature_celsius": _reading(
            pynvml, lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        ),
        "power_watts": _reading(pynvml, lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000),
    }


def _reading(pynvml, read: Callable[[], float]) -> float | None:
    """A reading the device may not support (power, on some boards): None then."""
    try:
        return read()
    except pynvml.NVMLError:
        return None
