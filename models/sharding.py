"""Tensor and data parallelism: a model's weights and caches placed on a mesh with axes ("data", "model").

Every cache decision is per (batch row, KV head), so rows go over "data" and KV heads over "model" with no communication
inside `attend` / `update`; the projections split the usual Megatron way (the joined q/k/v by KV head, each with its
query heads, Gemma 4's q, k, v apart and gate/up by output columns, o and down by input rows, the embedding and LM head
by vocabulary), so XLA adds one reduction after each row-split product. The decoder runs each layer's attend and update
(shared prefixes included) under `shard_map` with `layer_specs` (so the Pallas kernels see their shard; rows or KV heads
that do not divide are replicated along their axis); the rest follows by sharding propagation under `jit`.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jcascade.models import weights
from jcascade.models.config import ModelConfig

from jcascade import cache_state
from jcascade.shared import SharedPrefix

AXES = ("data", "model")

# Logical axis (`models.weights`) -> mesh axis: the Megatron split (q/k/v by KV head and gate/up by output columns,
# o and down by input rows, the embedding and LM head by vocabulary); other axes are replicated.
LOGICAL_RULES: dict[str, str] = {"vocab": "model", "q": "model", "kv": "model", "kv_heads": "model", "mlp": "model"}
# a logical axis -> the group that is split all together or not at all
GROUPS = {"q": "attention", "kv": "attention", "kv_heads": "attention", "mlp": "MLP", "vocab": "vocabulary"}


def parse_mesh(text: str) -> tuple[int, int]:
    """ "data=2,model=4" -> (2, 4); an axis left out is 1. Raises ValueError."""
    axes = {}
    try:
        for part in text.split(","):
            name, value = part.split("=")
            if name.strip() not in AXES or name.strip() in axes or int(value) < 1:
                raise ValueError
            axes[name.strip()] = int(value)
    except ValueError:
        raise ValueError(f"expected data=D,model=M (each axis at most once) with positive ints, got {text!r}") from None
    return axes.get("data", 1), axes.get("model", 1)


def device_mesh(shape: tuple[int, int] | None, batched: bool, name: str = "mesh") -> Mesh | None:
    """The ("data", "model") mesh of `shape` = (data, model) over the first data x model devices, or None for
    one device. `shape` None: a batched run splits its rows over every device (data parallelism), a run of
    one sequence uses one device (give (1, M) for tensor parallelism). Errors call the shape `name`."""
    devices = jax.devices()
    if shape is None:
        shape = (len(devices), 1) if batched else (1, 1)
    data, model = shape
    if data > 1 and not batched:
        raise ValueError(
            f"{name} data={data}: this command runs one sequence, so the data axis must be 1 (use data=1,model=M)"
        )
    if data * model > len(devices):
        raise ValueError(f"{name} data={data},model={model} needs {data * model} devices, {len(devices)} are available")
    if data * model == 1:
        return None
    return Mesh(np.array(devices[: data * model]).reshape(data, model), AXES)


def check_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh with axes {AXES}, got {getattr(mesh, 'axis_names', type(mesh).__name__)}"
        )


def weight_specs(config: ModelConfig, mesh: Mesh, rules: dict[str, tuple] | None = None) -> dict[str, PartitionSpec]:
    """The PartitionSpec of every weight of the config: its logical axes (`models.weights`) mapped by
    `LOGICAL_RULES`, or `rules[name]` (mesh axes, the layer axis included) where given. A group whose size does
    not divide by the "model" axis (attention: both head counts; MLP: the intermediate size; the vocabulary) is
    replicated along it, with one warning naming it."""
    check_mesh(mesh)
    m = mesh.shape["model"]
    splits = {
        "attention": config.num_heads % m == 0 and config.num_kv_heads % m == 0 and config.kv_heads("global") % m == 0,
        "MLP": config.intermediate_size % m == 0,
        "vocabulary": config.vocab_size % m == 0,
    }
    replicated = [
        f"{group} ({size})"
        for group, size in (
            ("attention", f"{config.num_heads} / {config.num_kv_heads} heads"),
            ("MLP", f"intermediate size {config.intermediate_size}"),
            ("vocabulary", f"{config.vocab_size} tokens"),
        )
        if not splits[group]
    ]
    if replicated:
        warnings.warn(
            f"not divisible by the mesh's model axis ({m}), replicated along it: {', '.join(replicated)}", stacklevel=3
        )
    specs = {}
    for name, axes in weights.logical_axes(config).items():
        mesh_axes = (rules or {}).get(name) or tuple(LOGICAL_RULES.get(a) if a else None for a in axes)
        groups = {GROUPS[a] for a in axes if a in GROUPS}
        if not all(splits[g] for g in groups):
            mesh_axes = tuple(None if a == "model" else a for a in mesh_axes)
        specs[name] = PartitionSpec(*mesh_axes)
    return specs


def cache_specs(state: cache_state.CacheState, mesh: Mesh) -> cache_state.CacheState:
    """PartitionSpecs of a stacked cache `state` (its fields' specs, in a state of its kind): rows over "data", KV
    heads over "model" (replicated along an axis that does not divide them)."""
    batch, num_kv_heads = state.seen.shape[-1], state.pos.shape[-2]
    rows = "data" if batch % mesh.shape["data"] == 0 else None
    heads = "model" if num_kv_heads % mesh.shape["model"] == 0 else None
    slot = PartitionSpec(None, rows, heads, None)
    stack = PartitionSpec(None, rows, heads, None, None)
    kv = state.k.map(lambda x: stack if x.ndim == 5 else slot)  # the codes' scales, if any, are per slot
    return dataclasses.replace(state, k=kv, v=kv, score=slot, pos=slot, seen=PartitionSpec(None, rows))


def linear_state_specs(state, mesh: Mesh):
    """PartitionSpecs of stacked linear-layer states (`delta_net.LinearState`): rows over "data" (replicated along
    it when they do not divide), the rest replicated: the Gated DeltaNet's weights are replicated along "model"."""
    rows = "data" if state.recurrent.shape[1] % mesh.shape["data"] == 0 else None
    return jax.tree.map(lambda a: PartitionSpec(None, rows, *(None,) * (a.ndim - 2)), state)


def layer_specs(state: cache_state.CacheState, mesh: Mesh, prefixes: tuple = ()) -> dict | None:
    """PartitionSpecs of one layer's attend/update arguments, for a model's stacked cache `state`: the layer's view
    of the cache (the K/V stack, its own scores, positions and clock), chunk tensors [B, T, heads, D], lengths [B]
    and one layer of each shared-prefix level (`prefixes`: `jcascade.SharedPrefix` levels, layers stacked). Rows go
    over "data" and KV heads over "model" where they divide, else are replicated along that axis (each device then
    repeats the work of its rows or heads: the weights put the heads there anyway). None when a level's rows
    neither divide over the cache rows' "data" nor are one row (attend/update then follow sharding propagation)."""
    stacked = cache_specs(state, mesh)
    rows, heads = stacked.k.data[1], stacked.k.data[2]  # "data" / "model", or None (replicated)
    num_kv_heads = state.pos.shape[-2]
    own = lambda spec: PartitionSpec(*spec[1:])  # without the layer axis
    state = cache_state.map_layer_fields(own, stacked, layer=PartitionSpec())
    levels = []
    for prefix in prefixes:
        level_rows = prefix.length.shape[-1]
        if rows and level_rows % mesh.shape["data"] and level_rows != 1:
            return None
        row = rows if level_rows % mesh.shape["data"] == 0 else None
        key_pos_heads = heads if prefix.key_pos.shape[-2] == num_kv_heads else None  # 1 or Hkv
        kv = prefix.k.map(lambda x: PartitionSpec(row, heads, *(None,) * (x.ndim - 3)))  # a layer: data, codes' scales
        levels.append(
            SharedPrefix(
                k=kv,
                v=kv,
                valid=PartitionSpec(row, heads, None),
                key_pos=PartitionSpec(row, key_pos_heads, None),
                length=PartitionSpec(row),
                rope=prefix.rope,
            )
        )
    return dict(
        state=state, chunk=PartitionSpec(rows, None, heads, None), lengths=PartitionSpec(rows), prefixes=tuple(levels)
    )


def embed(table: jax.Array, tokens: jax.Array, mesh: Mesh | None, spec: PartitionSpec | None) -> jax.Array:
    """Rows of `table` [V, H] (placed by `spec` on `mesh`) for tokens int32 [B, T]: [B, T, H]. With the
    vocabulary split over "model", each device looks up the tokens among its own rows and one sum over
    "model" joins them (Megatron's vocabulary-parallel embedding); sharding propagation would instead
    gather the whole table to every device on each call (2 ms of an 8B decode step on two H200s). Token
    ids outside [0, V) give zero rows here (`jnp.take` gives NaN rows for ids >= V and wraps negative ones);
    `generate` and `score` reject such ids before any lookup."""
    if mesh is None or tuple(spec) != ("model", None):
        return jnp.take(table, tokens, axis=0)

    def local(table, tokens):
        rows = table.shape[0]
        first = jax.lax.axis_index("model") * rows
        mine = (tokens >= first) & (tokens < first + rows)
        x = jnp.take(table, jnp.where(mine, tokens - first, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)), "model")

    rows = "data" if tokens.shape[0] % mesh.shape["data"] == 0 else None
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec("model", None), PartitionSpec(rows, None)),
        out_specs=PartitionSpec(rows, None, None),
    )(table, tokens)


def place(tree, specs, mesh: Mesh):
    """`tree` with every leaf constrained to its spec: device_put on concrete arrays, a sharding constraint
    under jit."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.lax.with_sharding_constraint(tree, shardings)
