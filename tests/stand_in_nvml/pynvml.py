"""NVML as the driver answers it on a machine with two GPUs, for the worker processes
started with this folder first on PYTHONPATH: the second GPU runs the asking process (1 GiB)
and another one (2 GiB), and cannot read its power draw, as some boards cannot."""

import os
from dataclasses import dataclass
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
GIB = 2**30


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


@dataclass(frozen=True)
class Device:
    uuid: str
    name: str
    utilization: int
    temperature: int
    milliwatts: int | None


DEVICES = [
    Device("GPU-0a0a0a0a-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", 12, 41, 96_500),
    Device("GPU-1b1b1b1b-1111-1111-1111-111111111111", "NVIDIA H100 80GB HBM3", 87, 64, None),
]


def nvmlInit() -> None:  # pynvml's names, as the worker calls them
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(DEVICES)


def nvmlDeviceGetHandleByIndex(index: int) -> Device:
    return DEVICES[index]


def nvmlDeviceGetHandleByUUID(uuid: str) -> Device:
    return next(device for device in DEVICES if device.uuid == uuid)


def nvmlDeviceGetUUID(device: Device) -> str:
    return device.uuid


def nvmlDeviceGetName(device: Device) -> str:
    return device.name


def nvmlDeviceGetMemoryInfo(device: Device) -> SimpleNamespace:
    return SimpleNamespace(used=5 * GIB, total=80 * GIB, free=75 * GIB)


def nvmlDeviceGetComputeRunningProcesses(device: Device) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 * GIB),
        SimpleNamespace(pid=1, usedGpuMemory=2 * GIB),
    ]


def nvmlDeviceGetUtilizationRates(device: Device) -> SimpleNamespace:
    return SimpleNamespace(gpu=device.utilization, memory=0)


def nvmlDeviceGetTemperature(device: Device, sensor: int) -> int:
    return device.temperature


def nvmlDeviceGetPowerUsage(device: Device) -> int:
    if device.milliwatts is None:
        raise NVMLError_NotSupported("Not Supported")
    return device.milliwatts
