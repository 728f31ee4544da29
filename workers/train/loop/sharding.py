"""A training state spread over the ranks with FSDP2 (`--sharding grad-op|full`), and its
checkpoints: each rank writes and reads its own part through torch.distributed.checkpoint
(DCP), which also gives a checkpoint to a job of another world size, resharded. GPU-side:
imports torch.

Each down block, the mid block and each up block is a unit of its own: its weights are
gathered for its forward pass (and, with `full`, freed after it and gathered again for its
backward), its gradients reduce-scattered as soon as its backward is done, so one unit's
communication overlaps the next one's compute. The weights stay fp32 and autocast casts
them as it does under DDP: a sharded run follows the DDP run's loss curve within float
tolerance (the reduce-scatter adds in another order than the all-reduce).

A checkpoint written so is a folder of DCP's files (`sharded/`: one per rank and their
metadata) beside the U-Net's config (`unet/config.json`): DCP copies the rank's part to host
memory (the devices wait for that copy only), then writes it on a thread of its own while
the training goes on; the worker's thread uploads it once written.
"""

import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from diffusers import UNet2DConditionModel
from diffusers.training_utils import EMAModel
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from sdq.models.registry import file_sha256
from sdq.workers.train.loop.files import UNET_FOLDER, save_unet_config
from sdq.workers.train.loop.state import TrainState

SHARDED_FOLDER = "sharded"
GRAD_COMM_DTYPE = {"fp32": None, "bf16": torch.bfloat16}


def shard_units(unet: UNet2DConditionModel) -> Iterator[torch.nn.Module]:
    """The U-Net's blocks, each gathered and freed as one (the root holds what is left: the
    input and output convolutions and the time embedding)."""
    yield from unet.down_blocks
    yield unet.mid_block
    yield from unet.up_blocks


def shard(unet: UNet2DConditionModel, sharding: str, grad_comm: str, device: torch.device):
    """The U-Net's parameters become this rank's shards (DTensors), in place: `unet` is
    still the model the steps call."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=GRAD_COMM_DTYPE[grad_comm])
    # grad-op keeps the gathered weights from the forward to the backward: no second gather.
    free_after_forward = sharding == "full"
    for unit in shard_units(unet):
        fully_shard(unit, mesh=mesh, reshard_after_forward=free_after_forward, mp_policy=policy)
    fully_shard(unet, mesh=mesh, reshard_after_forward=free_after_forward, mp_policy=policy)


def is_sharded(folder: Path) -> bool:
    """Whether a checkpoint's state folder was written by a sharded run."""
    return (folder / SHARDED_FOLDER).is_dir()


@dataclass
class ShardedSnapshot:
    """This rank's part of the state at one step, being written by DCP into `folder`;
    rank 0's also holds the whole U-Net, gathered, when the checkpoint is a model."""

    step: int
    unet_config: dict
    folder: Path
    saved: Future  # DCP's write of `folder`, on its own thread
    rank: int
    group: Any  # the checkpoints' process group (see state_group)
    # The U-Net's state dict (with the EMA's weights, when kept) on rank 0, for export.
    model_weights: dict[str, torch.Tensor] | None
    seconds: float
    # Set once the part is in the store (or failed to get there): the next checkpoint's
    # writers gather on the same group.
    uploaded: threading.Event = field(default_factory=threading.Event)

    def files(self) -> list[Path]:
        """The files of this rank's part, once written (rank 0's includes the metadata and
        the config)."""
        self.saved.result()
        return sorted(
            path
            for path in self.folder.rglob("*")
            if path.is_file() and (self.rank == 0 or path.name.startswith(f"__{self.rank}_"))
        )

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.uploaded.set()


@cache
def state_group():
    """A process group of its own for the checkpoints, made once per process (by every rank
    at the same point): DCP's writer thread and the uploads gather on it while the
    training's collectives go on, on the default group."""
    return dist.new_group(backend="gloo")


def sharded_snapshot(state: TrainState, exports: bool) -> ShardedSnapshot:
    """The rank's part of `state` copied to host memory and handed to DCP's writer; with
    `exports`, the whole U-Net gathered to rank 0 as well (every rank takes part)."""
    started = perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="sdq-sharded-"))
    if state.ranks.writes:
        save_unet_config(state.unet.config, folder / UNET_FOLDER)
    whole_unet = _whole_unet(state) if exports else None
    saved = dcp.async_save(
        _state_dict(state),
        checkpoint_id=folder / SHARDED_FOLDER,
        process_group=state.checkpoint_group,
    )
    return ShardedSnapshot(
        step=state.step,
        unet_config=dict(state.unet.config),
        folder=folder,
        saved=saved,
        rank=state.ranks.rank,
        group=state.checkpoint_group,
        model_weights=whole_unet,
        seconds=perf_counter() - started,
    )


def restore(state: TrainState, folder: Path) -> None:
    """`state` (new, on this job's ranks) given a sharded checkpoint's values, resharded
    by DCP when it was written at another world size."""
    state_dict = _state_dict(state)
    dcp.load(state_dict, checkpoint_id=folder / SHARDED_FOLDER, no_dist=not dist.is_initialized())
    set_state_dict(
        state.unet,
        state.optimizer,
        model_state_dict=state_dict["unet"],
        optim_state_dict=state_dict["optimizer"],
    )
    training = state_dict["training"]
    state.step = training["step"]
    state.lr_scheduler.load_state_dict(training["lr_scheduler"])
    if state.ema is not None:
        state.ema.load_state_dict({**training["ema"], "shadow_params": state.ema.shadow_params})
    if state.scaler is not None:
        state.scaler.load_state_dict(training["scaler"])


def unet_weights(folder: Path) -> UNet2DConditionModel:
    """The U-Net of a sharded checkpoint, whole, in this process (a new run that starts from
    it, on any number of ranks): laid out on the meta device, then read into."""
    config = UNet2DConditionModel.load_config(folder / UNET_FOLDER)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    unet.to_empty(device="cpu")
    weights = {"unet": unet.state_dict()}
    dcp.load(weights, checkpoint_id=folder / SHARDED_FOLDER, no_dist=True)
    unet.load_state_dict(weights["unet"])
    return unet


def _state_dict(state: TrainState) -> dict[str, Any]:
    """What a sharded checkpoint holds, keyed as DCP reads it back: the U-Net's and the
    optimizer's shards by parameter name, the EMA's shards by the same names, and the rest
    of the training state (the same on every rank)."""
    unet, optimizer = get_state_dict(state.unet, state.optimizer)
    names = [name for name, _ in state.unet.named_parameters()]
    ema = dict(zip(names, state.ema.shadow_params, strict=True)) if state.ema else {}
    return {
        "unet": unet,
        "optimizer": optimizer,
        "ema": ema,
        "training": {
            "step": state.step,
            "lr_scheduler": state.lr_scheduler.state_dict(),
            "ema": _ema_counters(state.ema),
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        },
    }


def _ema_counters(ema: EMAModel | None) -> dict[str, Any] | None:
    if ema is None:
        return None
    return {key: value for key, value in ema.state_dict().items() if key != "shadow_params"}


def _whole_unet(state: TrainState) -> dict[str, torch.Tensor] | None:
    """The U-Net's weights gathered from every rank (its EMA's, when kept), on rank 0's
    host; None on the others."""
    weights = dict(state.unet.state_dict())
    if state.ema is not None:
        names = [name for name, _ in state.unet.named_parameters()]
        weights.update(zip(names, state.ema.shadow_params, strict=True))
    whole = {name: _gathered(tensor) for name, tensor in weights.items()}
    return whole if state.ranks.writes else None


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to("cpu", copy=True)


def shard_hashes(snapshot: ShardedSnapshot) -> dict[str, str]:
    """The sha256 of each file of this rank's part, by its path in the checkpoint."""
    return {
        path.relative_to(snapshot.folder).as_posix(): file_sha256(path) for path in snapshot.files()
    }


def every_rank_hashes(snapshot: ShardedSnapshot, own: dict[str, str]) -> dict[str, str]:
    """Every rank's file hashes, gathered once each has uploaded its part."""
    gathered: list[dict[str, str] | None] = [None] * dist.get_world_size(snapshot.group)
    dist.all_gather_object(gathered, own, group=snapshot.group)
    return {path: digest for part in gathered for path, digest in (part or {}).items()}
