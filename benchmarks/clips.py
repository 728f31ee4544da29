"""CLIP models built in code with random weights and saved as transformers folders (model,
tokenizer, image processor), with a LAION-layout aesthetic head: CLIP ViT-L/14's shape
(the one curation uses, and SD 1.5's safety checker's vision tower), and the curate
benchmark's width-reduced one for a CPU. Only torch, transformers and safetensors."""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

# The tokenizer's special tokens: a byte-level vocabulary below them (tokens of letters).
START, END = 998, 999
# openai/clip-vit-large-patch14.
VIT_L14_VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                  "num_hidden_layers": 24, "patch_size": 14, "image_size": 224}  # fmt: skip
VIT_L14_TEXT = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
                "num_hidden_layers": 12, "num_attention_heads": 12,
                "max_position_embeddings": 77}  # fmt: skip
VIT_L14_WIDTH = 768
# A width-reduced ViT-B-like CLIP: the shape of the work, a fraction of its FLOPs.
NARROW_VISION = {"hidden_size": 192, "intermediate_size": 768, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "image_size": 112, "patch_size": 16}  # fmt: skip
NARROW_TEXT = {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 512,
               "num_hidden_layers": 4, "num_attention_heads": 4,
               "max_position_embeddings": 77}  # fmt: skip
NARROW_WIDTH = 128


def build_clip(
    folder: Path,
    vision: dict = NARROW_VISION,
    text: dict = NARROW_TEXT,
    width: int = NARROW_WIDTH,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """The CLIP model, its tokenizer (a byte-level vocabulary) and image processor, saved."""
    torch.manual_seed(0)
    special = {"bos_token_id": START, "eos_token_id": END, "pad_token_id": END}
    config = CLIPConfig(text_config={**text, **special}, vision_config=vision,
                        projection_dim=width)  # fmt: skip
    CLIPModel(config).to(dtype).save_pretrained(folder)
    letters = [chr(code) for code in range(33, 127)] + [
        f"{chr(code)}</w>" for code in range(97, 123)
    ]
    vocab = {token: index for index, token in enumerate(letters)}
    vocab.update({"<|startoftext|>": START, "<|endoftext|>": END})
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77).save_pretrained(folder)
    size = vision["image_size"]
    crop = {"height": size, "width": size}
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size=crop).save_pretrained(folder)
    return folder


def build_head(path: Path, width: int = NARROW_WIDTH) -> Path:
    """LAION's improved aesthetic predictor's layout (layers.0, 2, 4, 6, 7) on `width`."""
    torch.manual_seed(1)
    widths, indices = [width, 1024, 128, 64, 16, 1], [0, 2, 4, 6, 7]
    state = {}
    for index, inputs, outputs in zip(indices, widths, widths[1:], strict=False):
        layer = torch.nn.Linear(inputs, outputs)
        state[f"layers.{index}.weight"], state[f"layers.{index}.bias"] = layer.weight, layer.bias
    save_file({name: tensor.detach().contiguous() for name, tensor in state.items()}, path)
    return path
