"""The train step's options on the CPU path, checked against the arithmetic they stand for:
v-prediction with min-SNR weighting, LR warmup, EMA, bf16 autocast, gradient
checkpointing."""

import copy

import pytest
import torch
import torch.nn.functional as F

from sdq.models import tiny
from sdq.models.registry import tiny_identity
from sdq.models.training import TrainOptions, TrainShardSpec
from sdq.workers.tiny import build_unet
from sdq.workers.train.trainer import draw, new_state, train_step

BATCH = 2


def spec(prediction_type: str = "epsilon", **options) -> TrainShardSpec:
    model = tiny_identity()
    return TrainShardSpec(
        run=0, first_step=0, last_step=3, model_name="test", base_name=model.name,
        base_source=model.source, base_revision=model.revision,
        prediction_type=prediction_type, scheduler_config=model.scheduler_config,
        options=TrainOptions(steps=3, batch_size=BATCH, **options),
    )  # fmt: skip


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = tiny.UNET_CONFIG["sample_size"]
    latents = torch.randn((BATCH, 4, size, size), generator=generator)
    embeddings = torch.randn(
        (BATCH, 7, tiny.UNET_CONFIG["cross_attention_dim"]), generator=generator
    )
    return latents, embeddings


def test_v_prediction_with_min_snr_is_the_weighted_velocity_error() -> None:
    shard = spec("v_prediction", min_snr=5.0, ema=None)
    state = new_state(shard, build_unet())
    before = copy.deepcopy(state.unet)
    latents, embeddings = batch(1)
    # The draws of step 1: a function of the seed, the step and the sample alone.
    draws = draw(state, shard, latents.shape[1:])
    noise, steps = draws.noise, draws.timesteps

    loss = train_step(state, shard, latents, embeddings)

    alphas = state.noise_scheduler.alphas_cumprod[steps]
    a, s = alphas.sqrt().view(-1, 1, 1, 1), (1 - alphas).sqrt().view(-1, 1, 1, 1)
    noisy, velocity = a * latents + s * noise, a * noise - s * latents
    snr = alphas / (1 - alphas)
    weights = torch.clamp(snr, max=5.0) / (snr + 1)
    with torch.no_grad():
        prediction = before(noisy, steps, embeddings).sample
    errors = F.mse_loss(prediction, velocity, reduction="none").mean(dim=[1, 2, 3])
    assert loss == pytest.approx((errors * weights).mean().item(), rel=1e-4)


def test_warmup_ema_bf16_and_gradient_checkpointing_train() -> None:
    shard = spec(lr=1e-3, lr_warmup=4, ema=0.5, mixed_precision="bf16", gradient_checkpointing=True)
    state = new_state(shard, build_unet())
    assert state.unet.is_gradient_checkpointing
    start = [p.detach().clone() for p in state.unet.parameters()]
    rates = []
    for seed in range(3):
        loss = train_step(state, shard, *batch(seed))
        assert torch.isfinite(torch.tensor(loss))
        rates.append(state.optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([1e-3 / 4, 2e-3 / 4, 3e-3 / 4])  # linear warmup
    moved = [p.detach() for p in state.unet.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(start, moved, strict=True))
    # The EMA weights trail the trained ones instead of copying them.
    shadow = state.ema.shadow_params
    assert any(not torch.equal(e, m) for e, m in zip(shadow, moved, strict=True))
