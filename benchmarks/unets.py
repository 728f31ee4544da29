"""The U-Nets the train benchmarks train, by name: SD 2's at a tenth of its width (its
depth, blocks, attention layout with 32-wide heads and linear projections, on the tiny text
encoder's embeddings: the real model's kind of work at a CPU's scale; 8.5M parameters), the
tiny model's own (two levels deep), and the real architectures."""

from sdq.models import tiny
from sdq.models.train.architectures import UNET_ARCHITECTURES

UNETS = {
    "sd2-narrow": {
        **UNET_ARCHITECTURES["sd2-base"],
        "block_out_channels": [32, 64, 128, 128],
        "attention_head_dim": [1, 2, 4, 4],
        "cross_attention_dim": tiny.UNET_CONFIG["cross_attention_dim"],
        "sample_size": 8,  # the CPU benchmarks' 64 px
    },
    "tiny": tiny.UNET_CONFIG,
    **UNET_ARCHITECTURES,
}
