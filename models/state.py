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


def _named_leaves(state: ModelState) -> tuple[list[tuple[str, jax.Array]], jax.tree_util.PyTreeDef]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    return [(".".join(str(getattr(key, "name", key)) for key in path), x) for path, x in leaves], treedef


def saved_arrays(state: ModelState) -> dict[str, jax.Array]:
    """The state's arrays by name ("cache.k.data", "cache.k.scale", "cache.pos", "window.seen", "linear.recurrent",
    ...): what a checkpoint saves. The names and dtypes record the storage format (codes with their scales, or
    keys and values in the model's dtype)."""
    return dict(_named_leaves(state)[0])


def restored(arrays: dict, like: ModelState, where: str) -> ModelState:
    """The `ModelState` of `saved_arrays` read back, checked against `like` (the state the run makes: e.g.
    `jax.eval_shape` of its `init_cache`, whose static parts it keeps): a ValueError naming `where` and each array
    missing, extra, or of another dtype or shape (a cache stored in another format, or another policy or model)."""
    leaves, treedef = _named_leaves(like)
    wanted = dict(leaves)
    differ = [f"{name} (saved, not made by this run)" for name in arrays if name not in wanted]
    for name, want in leaves:
        got = arrays.get(name)
        if got is None:
            differ.append(f"{name} (not saved; this run stores {want.dtype}{list(want.shape)})")
        elif (got.dtype, tuple(got.shape)) != (want.dtype, tuple(want.shape)):
            saved, wanted = f"{got.dtype}{list(got.shape)}", f"{want.dtype}{list(want.shape)}"
            differ.append(f"{name} (saved {saved}, this run stores {wanted})")
    if differ:
        raise ValueError(f"{where}: holds another state than this run makes, it differs in: {'; '.join(differ)}")
    return jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(arrays[name]) for name, _ in leaves])
