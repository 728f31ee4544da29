"""Run under torchrun (2 gloo ranks), for each configuration (a sharding and a gradient
communication): four steps of the tiny U-Net on fixed batches, with checkpoints written
through sdq's own writer into a local store at steps 2 and 4; then a state restored from
step 2's checkpoint takes steps 3 and 4 again. Rank 0 leaves the losses and the whole
weights of both (gathered) in OUT/SHARDING-GRAD_COMM for the test to compare. The
configurations run one after another in the same two processes: every seed is set
explicitly, so each trains as it would in processes of its own.

    torchrun --nproc-per-node 2 tests/sharded/train_two_ranks.py OUT SHARDING:GRAD_COMM...
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from sdq.models import tiny
from sdq.models.registry import tiny_identity
from sdq.models.store import LocalStore
from sdq.models.train.specs import TrainOptions, TrainShardSpec, checkpoint_prefix
from sdq.workers.tiny import build_unet
from sdq.workers.train.loop.build import downloaded, load_checkpoint, new_state
from sdq.workers.train.loop.checkpoints import write_checkpoint
from sdq.workers.train.loop.state import Ranks
from sdq.workers.train.loop.step import step_inputs, train_step
from sdq.workers.train.loop.training import Training
from sdq.workers.train.ranks.serve import exit_now, ranks_from_env
from sdq.workers.weights import ModelFiles

BATCH, STEPS = 4, 4


def spec(sharding: str, grad_comm: str) -> TrainShardSpec:
    model = tiny_identity()
    options = TrainOptions(
        steps=STEPS, batch_size=BATCH, world_size=2, sharding=sharding, grad_comm=grad_comm,
        grad_accumulation=2, ema=0.9, lr=1e-3, lr_schedule="cosine", lr_warmup=1,
        max_grad_norm=1.0, checkpoint_every=2,
    )  # fmt: skip
    return TrainShardSpec(
        run=0, first_step=0, last_step=2, model_name="sharded", base_name=model.name,
        base_source=model.source, base_revision=model.revision, prediction_type="epsilon",
        scheduler_config=model.scheduler_config, options=options,
    )  # fmt: skip


def batch(step: int, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    size, width = tiny.UNET_CONFIG["sample_size"], tiny.UNET_CONFIG["cross_attention_dim"]
    latents = torch.randn((BATCH, 4, size, size), generator=generator)
    embeddings = torch.randn((BATCH, 7, width), generator=generator)
    return latents[part], embeddings[part]


def take_steps(state, shard: TrainShardSpec, last: int, checkpoint) -> list[float]:
    losses = []
    while state.step < last:
        latents, embeddings = batch(state.step + 1, state.ranks.part(BATCH))
        inputs = step_inputs(state, shard, latents, embeddings)
        losses.append(train_step(state, shard, inputs).item())
        checkpoint(state)
    return losses


def whole_weights(state) -> dict[str, torch.Tensor]:
    """The U-Net's and the EMA's weights, gathered whole (every rank takes part)."""
    names = [name for name, _ in state.unet.named_parameters()]
    weights = dict(state.unet.state_dict())
    if state.ema is not None:
        weights.update({f"ema.{n}": p for n, p in zip(names, state.ema.shadow_params, strict=True)})
    if dist.get_world_size() > 1 and state.sharded:
        weights = {name: tensor.full_tensor() for name, tensor in weights.items()}
    return {name: tensor.detach().clone().contiguous() for name, tensor in weights.items()}


def main(out: Path, configurations: list[str]) -> None:
    ranks = ranks_from_env()
    dist.init_process_group("gloo")
    for configuration in configurations:
        sharding, grad_comm = configuration.split(":")
        folder = out / f"{sharding}-{grad_comm}"
        folder.mkdir(parents=True, exist_ok=True)
        train(folder, sharding, grad_comm, ranks)
        dist.barrier()
    dist.destroy_process_group()
    # As sdq's ranks end: gloo's threads, freed at exit, can abort the process ("terminate
    # called without an active exception", seen once in a CI run) or deadlock it.
    exit_now(0)


def train(out: Path, sharding: str, grad_comm: str, ranks: Ranks) -> None:
    store = LocalStore(out / "store")
    files = ModelFiles(store, out / f"models-{ranks.rank}")
    shard = spec(sharding, grad_comm)

    def checkpoint(state) -> None:
        if state.step % 2:
            return
        job = replace(shard, first_step=state.step - 2, last_step=state.step)
        training = Training.__new__(Training)  # the writer's side alone: no data stream
        training.state, training._writing = state, None
        snapshot = training.checkpoint(job)
        written = write_checkpoint(job, snapshot, store, files) if snapshot else None
        if written is not None:
            (out / f"written-{state.step}.json").write_text(json.dumps(written.__dict__))
        dist.barrier()

    straight = new_state(shard, build_unet(), ranks)
    losses = take_steps(straight, shard, STEPS, checkpoint)
    node = out / "node"  # the ranks' shared folder: the checkpoint is downloaded once
    node.mkdir(exist_ok=True)
    with downloaded(store, f"{checkpoint_prefix(0, 2)}/state/", node) as folder:
        resumed = load_checkpoint(replace(shard, first_step=2, last_step=4), folder, ranks)
    assert resumed.step == 2
    resumed_losses = take_steps(resumed, shard, STEPS, lambda state: None)
    weights = {"straight": whole_weights(straight), "resumed": whole_weights(resumed)}
    if ranks.writes:
        for name, tensors in weights.items():
            save_file(tensors, out / f"{name}.safetensors")
        (out / "losses.json").write_text(
            json.dumps({"straight": losses, "resumed": resumed_losses})
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
