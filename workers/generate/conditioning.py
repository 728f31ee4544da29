"""What a pipeline call is conditioned on: each text's text-encoder outputs, encoded once
and kept while the pipeline is loaded (and shared across workers where a deployment
shares them). GPU-side: imports torch.

Each pipeline family says what its `encode_prompt` gives per text: Stable Diffusion one
tensor (`prompt_embeds`), SDXL two (its two encoders' hidden states side by side, and the
second one's pooled output). The call takes each as NAME and its negative as negative_NAME.
"""

from collections import OrderedDict
from collections.abc import Callable

import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

from sdq.workers.generate.shared_prompts import EncoderPrompts

Rows = dict[str, torch.Tensor]  # a tensor per output name, a row per text
Encode = Callable[[DiffusionPipeline, list[str]], Rows]


def _stable_diffusion(pipeline: StableDiffusionPipeline, texts: list[str]) -> Rows:
    embeds, _ = pipeline.encode_prompt(texts, pipeline.device, 1, False)
    return {"prompt_embeds": embeds}


def _stable_diffusion_xl(pipeline: StableDiffusionXLPipeline, texts: list[str]) -> Rows:
    embeds, _, pooled, _ = pipeline.encode_prompt(
        texts, device=pipeline.device, num_images_per_prompt=1, do_classifier_free_guidance=False
    )
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


FAMILIES: dict[type[DiffusionPipeline], Encode] = {
    StableDiffusionPipeline: _stable_diffusion,
    StableDiffusionXLPipeline: _stable_diffusion_xl,
}


def family_encoder(pipeline: DiffusionPipeline) -> Encode | None:
    """How the pipeline's texts are encoded, where sdq knows its family; None: the
    pipeline is given the texts and encodes them itself."""
    return next((encode for family, encode in FAMILIES.items() if isinstance(pipeline, family)),
                None)  # fmt: skip


class PromptEmbeddings:
    """The text encoders' outputs for the last `size` texts (prompts and negative prompts
    alike) of one loaded pipeline, least recently used evicted first; in front of the
    deployment's shared ones (`shared`), where there are.

    Each text's rows are copies of their own: a view would keep its whole call's tensor on
    the device for as long as any one of its texts is kept."""

    def __init__(self, encode: Encode, size: int, shared: EncoderPrompts | None = None) -> None:
        self.encode = encode
        self.size = size
        self.shared = shared
        self.encoded = 0  # texts the text encoders have run on, for the benchmarks and tests
        self._kept: OrderedDict[str, Rows] = OrderedDict()

    def __call__(self, pipeline: DiffusionPipeline, texts: list[str]) -> Rows:
        """The outputs for `texts`, in order; the texts neither kept here nor shared are
        encoded in one call (and shared)."""
        missing = [text for text in dict.fromkeys(texts) if text not in self._kept]
        if missing and self.shared:
            found = self.shared.get(missing)
            for text, rows in found.items():
                self._kept[text] = {name: row.to(pipeline.device) for name, row in rows.items()}
            missing = [text for text in missing if text not in found]
        if missing:
            encoded = self.encode(pipeline, missing)
            rows = {
                text: {name: tensor[index].clone() for name, tensor in encoded.items()}
                for index, text in enumerate(missing)
            }
            self._kept.update(rows)
            self.encoded += len(missing)
            if self.shared:
                self.shared.put(rows)
        for text in texts:
            self._kept.move_to_end(text)
        names = self._kept[texts[0]]
        stacked = {name: torch.stack([self._kept[text][name] for text in texts]) for name in names}
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return stacked


def call_conditioning(
    prompts: PromptEmbeddings, pipeline: DiffusionPipeline, texts: list[str], negatives: list[str]
) -> dict[str, torch.Tensor]:
    """A call's prompt and negative prompt outputs, as the pipeline takes them.

    A pipeline that conditions on zeros when it is given no negative prompt (SDXL's
    `force_zeros_for_empty_prompt`) gets zeros for an empty one: the images its users
    get from it with no negative prompt."""
    conditioning = prompts(pipeline, texts)
    negative = prompts(pipeline, negatives)
    if getattr(pipeline.config, "force_zeros_for_empty_prompt", False):
        empty = [index for index, text in enumerate(negatives) if not text]
        for tensor in negative.values():
            tensor[empty] = 0  # stacked above: a tensor of this call's own
    return conditioning | {f"negative_{name}": tensor for name, tensor in negative.items()}
