"""The layer kinds of the decoder, one module each, with one call signature.

A kind builds a token mixer, `mixer(fetch, h, state, pending, index, layer_prefixes) -> (out, state, pending)`:
fetch gives the layer's weights by name, h [B, T, hidden] is the normed input, state the `ModelState`, index the
place of the layer's state in its type's stack, layer_prefixes the layer's shared-prefix levels; out is [B, T,
hidden] before the residual add. pending holds, by layer type, the keys, values and scores a layer leaves for the
layers that read its cache (`shared_kv`); the others pass it on.

- `cache_attention`: a global layer, attention over the cache policy's cache, then its update;
- `nope`: the same without rotary positions (`ModelConfig.nope_layers`);
- `window`: a sliding layer, attention over its window cache (`CausalLM.window_policy`);
- `shared_kv`: a layer whose cache later layers read, and those readers (`ModelConfig.kv_shared_layers`);
- `gated_delta_net`: a linear layer, the Gated DeltaNet and its recurrent state.

`kind_of` names each layer's kind; the decoder builds each kind once (`Context`) and dispatches layers by kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jcascade.models.config import GLOBAL, LINEAR, SLIDING, ModelConfig


@dataclasses.dataclass(frozen=True)
class Context:
    """What every layer of a chunk shares: the config, the global layers' cache policy and the sliding layers'
    (`window_policy`, None without sliding layers), the chunk's valid lengths [B] and shape, the model's RMSNorm
    (`norm(x, weight)`), whether q, k and v are joined, and on a sharded model its mesh and the PartitionSpecs of
    `sharding.layer_specs`."""

    cfg: ModelConfig
    policy: Any
    window_policy: Any
    lengths: jax.Array
    batch: int
    tokens: int
    norm: Callable
    fused_qkv: bool  # q, k and v of the layers without weights of their own stored joined (`weights.FUSED`)
    mesh: jax.sharding.Mesh | None = None
    specs: dict | None = None

    def rope(self, layer_type: str, rotary: bool):
        """The RoPE of a layer of `layer_type` (None for a layer that does not rotate)."""
        return None if not rotary else self.cfg.local_rope if layer_type == SLIDING else self.cfg.rope

    def layer_policy(self, layer_type: str):
        """The cache policy of the layers of `layer_type`."""
        return self.policy if layer_type == GLOBAL else self.window_policy


def kind_of(cfg: ModelConfig, layer: int) -> tuple[str, str, bool]:
    """(kind, layer type, rotary) of model layer `layer`: kind "linear", "shared_reader" (reads an earlier layer's
    cache), "shared_source" (its cache is read by later layers), "window" (sliding), "nope" (a global layer that does
    not rotate) or "cache"; rotary: whether its attention rotates q and k."""
    layer_type, rotary = cfg.types[layer], layer not in cfg.nope_layers
    if layer_type == LINEAR:
        kind = "linear"
    elif cfg.reads_from(layer) != layer:
        kind = "shared_reader"
    elif any(cfg.reads_from(i) == layer for i in range(layer + 1, cfg.num_layers)):
        kind = "shared_source"
    else:
        kind = "window" if layer_type == SLIDING else "cache" if rotary else "nope"
    return kind, layer_type, rotary


def build(ctx: Context, kind: str, layer_type: str, rotary: bool):
    """The mixer of layers of `kind_of`'s (kind, layer type, rotary)."""
    from jcascade.models.layers import cache_attention, gated_delta_net, nope, shared_kv, window

    if kind == "shared_source":
        return shared_kv.source(ctx, layer_type, rotary)
    if kind == "shared_reader":
        return shared_kv.reader(ctx, layer_type, rotary)
    return {
        "cache": cache_attention.mixer,
        "nope": nope.mixer,
        "window": window.mixer,
        "linear": gated_delta_net.mixer,
    }[kind](ctx)
