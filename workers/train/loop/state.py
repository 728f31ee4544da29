"""A rank's training state: its place among the ranks, and the model, optimizer, schedules
and EMA it trains. GPU-side: imports torch."""

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.training_utils import EMAModel

from sdq.workers.gpu import device_name


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job's data-parallel group (torchrun's RANK, WORLD_SIZE
    and LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def writes(self) -> bool:
        """Whether this rank writes the checkpoint (and keeps the EMA weights it holds)."""
        return self.rank == 0

    def device(self) -> torch.device:
        name = device_name()
        return torch.device(f"{name}:{self.local_rank}" if name == "cuda" else name)

    def part(self, global_batch: int) -> slice:
        """This rank's samples of a global batch."""
        share = global_batch // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def lanes(self, data_lanes: int) -> range:
        """This rank's data lanes, whose samples are its part of every global batch."""
        share = data_lanes // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)


@dataclass
class TrainState:
    run: int
    step: int
    unet: UNet2DConditionModel
    # The unet (its blocks compiled when asked), wrapped in DDP across ranks: what the steps
    # call.
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMAModel | None
    scaler: torch.amp.GradScaler | None
    noise_scheduler: DDPMScheduler
    device: torch.device
    ranks: Ranks
    # The text encoder's output for the empty prompt, for caption dropout.
    empty_prompt: torch.Tensor | None = None
    empty_pooled: torch.Tensor | None = None  # SDXL: its pooled embedding too
    # The U-Net's training FLOPs per sample, counted once for a state that lives on from
    # job to job (on a GPU, for MFU).
    flops_per_sample: float | None = None
    # A sharded state's process group for its checkpoints (sharding.state_group); None:
    # rank 0 writes the whole state.
    checkpoint_group: Any = None
    # A compiled state's artifacts, shared through the store (compiled.SharedCompile).
    compiled: Any = None
    # Whether the U-Net is frozen under a LoRA's adapters, which are all that trains.
    lora: bool = False

    @property
    def trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer and the EMA follow: the U-Net's, or its adapters'."""
        return [parameter for parameter in self.unet.parameters() if parameter.requires_grad]

    @property
    def sharded(self) -> bool:
        return self.checkpoint_group is not None


ALONE = Ranks()  # a process that trains by itself
