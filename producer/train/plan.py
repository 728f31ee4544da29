"""A training configuration's memory and FLOPs per GPU, planned before anything runs. The
planner builds the U-Net on torch's meta device (workers/train/plan.py); the CLI runs it as
a child process, so `sdq` itself never loads torch, and says plainly when torch is not
installed here."""

import importlib.util
import json
import re
import subprocess
import sys
from typing import Any

import click

from sdq.models.train.specs import TrainOptions

PLANNER = "sdq.workers.train.plan"
DEFAULT_GPU_MEMORY = "80GB"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


class CannotPlan(Exception):
    pass


def memory_size(_ctx, _param, value: str) -> int:
    """`80GB`, `40GiB`, `81920MiB` or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a size such as 80GB, 40GiB or 81920MiB")
    number, unit = match.groups()
    return int(float(number) * UNITS[(unit or "").upper()])


def can_plan() -> bool:
    return importlib.util.find_spec("torch") is not None


def plan(request: dict[str, Any]) -> dict[str, Any]:
    """The planner's answer for a request (workers/train/plan.py's PlanRequest fields)."""
    if not can_plan():
        raise CannotPlan("planning builds the U-Net with torch, which is not installed here")
    done = subprocess.run(
        [sys.executable, "-m", PLANNER, json.dumps(request)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode < 0:  # killed (the kernel's out-of-memory killer, say): no last words
        raise CannotPlan(f"the planner died (signal {-done.returncode})")
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise CannotPlan(f"the planner failed: {last[0]}")
    return json.loads(done.stdout)


def refusal(found: dict[str, Any]) -> str:
    """Why a configuration is refused, with its figures and what would make it fit."""
    gib = 2**30
    parts = ", ".join(f"{name} {size / gib:.1f}" for name, size in found["parts"].items())
    advice = (
        f"; {found['would_fit_with']} would make it fit"
        if found["would_fit_with"]
        else "; no gradient checkpointing or accumulation makes it fit: a smaller batch or "
        "resolution, or GPUs with more memory"
    )
    return (
        f"needs {found['per_gpu_bytes'] / gib:.1f} GiB per GPU ({parts} GiB) at a micro-batch "
        f"of {found['micro_batch']}, over the {found['usable_bytes'] / gib:.1f} GiB usable of "
        f"{found['gpu_memory'] / gib:.1f} GiB{advice}"
    )


GPU_MEMORY_OPTION = click.option(
    "--gpu-memory",
    default=DEFAULT_GPU_MEMORY,
    show_default=True,
    callback=memory_size,
    help="Each GPU's memory (80GB, 40GiB, ...): a configuration planned on the meta device "
    "(see `sdq train plan`) that it cannot hold is refused; `sdq train` plans runs given "
    "--unet-config, before they are queued.",
)


def plan_request(options: TrainOptions, resolution: int, gpu_memory: int) -> dict[str, Any]:
    return {
        "unet_config": options.unet_config,
        "resolution": resolution,
        "batch_size": options.batch_size,
        "world_size": options.world_size,
        "sharding": options.sharding,
        "grad_accumulation": options.grad_accumulation,
        "mixed_precision": options.mixed_precision,
        "gradient_checkpointing": options.gradient_checkpointing,
        "ema": options.ema is not None,
        "lora_rank": options.lora_rank,
        "lora_targets": options.lora_targets,
        "buckets": options.buckets,
        "gpu_memory": gpu_memory,
    }


def check_fits(options: TrainOptions, resolution: int, gpu_memory: int) -> None:
    try:
        found = plan(plan_request(options, resolution, gpu_memory))
    except CannotPlan as error:
        raise click.UsageError(str(error)) from None
    if not found["fits"]:
        raise click.UsageError(f"this run {refusal(found)} (`sdq train plan` shows the parts)")
