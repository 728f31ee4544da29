"""Text embeddings shared by every generate worker of a deployment, in Redis
(`SDQ_PROMPT_CACHE_URL`): a text goes through a text encoder once for all GPUs, and for
every model with the same text encoder (a base and its fine-tunes), in front of each
pipeline's own cache (conditioning.PromptEmbeddings). GPU-side: imports torch.

Entries are keyed by the text encoders' content (their weights, in the dtype they run in,
and their tokenizers' vocabularies) and the text; each holds the text's rows of every
output the pipeline is conditioned on (conditioning.py), as one safetensors record. The
cache holds at most `size` of them, the least recently used dropped first, by a sorted set
of last uses. A cache that cannot be reached is passed by: the worker encodes, as it would
without one."""

import hashlib
import json
import logging
import time
from collections.abc import Sequence

import redis
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load, save

logger = logging.getLogger(__name__)

# v2: a record of named rows (an SDXL text has two), where v1 held one unnamed tensor.
PREFIX = "sdq:prompts:v2:"
LAST_USED = PREFIX + "last-used"


# A pipeline's text encoders and tokenizers: one pair, or SDXL's two.
TEXT_COMPONENTS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


def text_encoder_digest(pipeline: DiffusionPipeline) -> str:
    """What a text's embeddings depend on besides the text: the text encoders' weights as
    they run (dtype included) and the tokenizers' vocabularies."""
    digest = hashlib.sha256()
    for encoder_name, tokenizer_name in TEXT_COMPONENTS:
        encoder = getattr(pipeline, encoder_name, None)
        if encoder is None:
            continue
        digest.update(type(encoder).__name__.encode())
        vocabulary = getattr(pipeline, tokenizer_name).get_vocab()
        digest.update(json.dumps(vocabulary, sort_keys=True).encode())
        for name, tensor in sorted(encoder.state_dict().items()):
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


class SharedPrompts:
    """One deployment's shared embeddings: a Redis client and the cache's bound."""

    def __init__(self, url: str, size: int) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.size = size

    def for_encoder(self, digest: str) -> "EncoderPrompts":
        return EncoderPrompts(self, digest)


class EncoderPrompts:
    """The shared embeddings of one pipeline's text encoders."""

    def __init__(self, shared: SharedPrompts, digest: str) -> None:
        self.shared = shared
        self.digest = digest

    def _key(self, text: str) -> str:
        return f"{PREFIX}{self.digest[:32]}:{hashlib.sha256(text.encode()).hexdigest()}"

    def get(self, texts: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """The rows of those texts that some worker has encoded (on the CPU), by name."""
        keys = {self._key(text): text for text in texts}
        try:
            values = self.shared.redis.mget(list(keys))
            found = {key: value for key, value in zip(keys, values, strict=True) if value}
            if found:
                self.shared.redis.zadd(LAST_USED, dict.fromkeys(found, time.time()))
        except redis.RedisError as error:
            logger.warning("shared prompt cache unavailable, encoding here: %r", error)
            return {}
        return {keys[key]: load(value) for key, value in found.items()}

    def put(self, embeddings: dict[str, dict[str, torch.Tensor]]) -> None:
        """Shares these texts' rows, then drops the least recently used past the bound."""
        entries = {
            self._key(text): save({name: row.cpu() for name, row in rows.items()})
            for text, rows in embeddings.items()
        }
        try:
            with self.shared.redis.pipeline() as batch:
                batch.mset(entries)
                batch.zadd(LAST_USED, dict.fromkeys(entries, time.time()))
                batch.execute()
            excess = self.shared.redis.zcard(LAST_USED) - self.shared.size
            if excess > 0:
                dropped = [key for key, _ in self.shared.redis.zpopmin(LAST_USED, excess)]
                self.shared.redis.delete(*dropped)
        except redis.RedisError as error:
            logger.warning("shared prompt cache unavailable, not shared: %r", error)
