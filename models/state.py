"""A model's state between chunks, by layer kind."""

from __future__ import annotations

import dataclasses

import jax
from jcascade.models.config import GLOBAL, LINEAR, SLIDING
from jcascade.models.delta_net import LinearState

from jcascade import cache_state

FIELDS = {GLOBAL: "cache", SLIDING: "window", LINEAR: "linear"}  # a layer type's field of `ModelState`


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelState:
    """What `CausalLM.init_cache` makes and every chunk updates. Each field is stacked on a leading axis over the
    layers of its type that keep a state of their own (`ModelConfig.layers_with_state`), None where the model has no
    layer of that type:

    - cache: the global layers' KV cache, under the cache policy the model runs with;
    - window: the sliding layers' window cache (`CausalLM.window_policy`);
    - linear: the Gated DeltaNet layers' recurrent states.

    `CausalLM.layer_cache` gives the cache a given model layer attends to."""

    cache: cache_state.CacheState
    window: cache_state.CacheState | None = None
    linear: LinearState | None = None

    def of(self, layer_type: str):
        """The stack of the layers of `layer_type` (GLOBAL, SLIDING or LINEAR)."""
        return getattr(self, FIELDS[layer_type])

    def replaced(self, layer_type: str, stack) -> ModelState:
        """This state with the stack of `layer_type` replaced by `stack`."""
        return dataclasses.replace(self, **{FIELDS[layer_type]: stack})
