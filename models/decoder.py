"""The Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 decoder as a Flax NNX module, attention delegated to jcascade's
cache policies.

These architectures share this decoder: pre-norm blocks of RMSNorm, grouped-query attention with rotary
positions (Qwen2 adds q/k/v biases, Qwen3 an RMSNorm of each head's q and k), and a SwiGLU MLP; Gemma 3 adds
(1 + w) norms after attention and MLP too, a GeLU-tanh MLP, scaled embeddings, and sliding-window layers with a
window cache of their own (`window_attention`; `with_sliding_policy` sets its policy) beside the global ones. Its
weights are declared in `models.weights`. The L layers' weights are stacked on a leading axis and run under
`lax.scan`, so a model compiles as one layer whatever its depth. Each layer calls
`jcascade.attend` then `jcascade.update` on its view of the cache, so every policy works unchanged. The
stacked cache is the scan's carry and is never sliced: each layer sees the whole K/V stack with its layer
index (`CacheState.layer`), the kernels and scatters read and write that layer in place, and only the
small per-slot arrays (scores, positions) are sliced and written back. The cache is held once
(tests/models/test_decoder.py) and a decode step moves no K/V beyond what it reads and inserts. A policy's
data-dependent branch that all layers take alike (`Policy.step_branch`) is decided once, around the loop.

Weights use the x @ W convention (W is [in, out], the transpose of PyTorch's Linear weight).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jcascade import cache_api, cache_state, shared
from jcascade.pallas_kernels import Kernels
from jcascade.policies import SlidingWindow, check_policy, policy_names
from jcascade.models import sharding
from jcascade.models.config import ModelConfig
from jcascade.models.weights import declarations, weight_shapes


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, gemma: bool = False) -> jax.Array:
    """As Hugging Face: normalise in float32, cast back, then scale by weight (Llama); with `gemma`, scale by
    (1 + weight) in float32, then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if gemma:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def window_attention(policy, state: cache_state.CacheState, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                     rope, window: int) -> tuple[jax.Array, cache_state.Scores | None]:
    """Sliding-window attention (Gemma 3's sliding layers, masked as Hugging Face masks them): the query at
    position p sees the keys at positions p - window + 1 .. p that the layer's cache (`state`, under `policy`)
    holds, and the chunk's. Exact when the cache holds the window - 1 tokens before the chunk (the default
    window cache). Keys are rotated at `policy.key_positions`; the window counts original positions.
    q [B, T, Hq, D], k, v [B, T, Hkv, D] un-rotated; lengths [B] valid queries. Returns out [B, T, Hq, D]
    (zeros for padding queries) and, for a policy that keeps scores, its increments (`Scores`, as
    `pallas_kernels.reference.chunk_attention` defines them). Plain XLA."""
    B, T, Hq, D = q.shape
    Hkv, f32, highest = k.shape[2], jnp.float32, jax.lax.Precision.HIGHEST
    cached_k, cached_v = cache_state.cached_kv(state)
    key_pos, start = policy.key_positions(state)
    rot_pos = start[:, None] + jnp.arange(T)  # [B, T] the chunk's RoPE positions
    q_pos = state.seen[:, None] + jnp.arange(T)  # [B, T] its original positions
    chunk = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
    keys = jnp.concatenate([rope(cached_k, key_pos), chunk(rope(k, rot_pos[:, :, None]))], axis=2)
    values = jnp.concatenate([cached_v, chunk(v)], axis=2)
    k_pos = jnp.concatenate([state.pos, jnp.broadcast_to(q_pos[:, None, :], (B, Hkv, T))], axis=2)  # [B, Hkv, S]
    k_valid = jnp.concatenate([state.pos >= 0, jnp.broadcast_to((jnp.arange(T) < lengths[:, None])[:, None, :],
                                                                (B, Hkv, T))], axis=2)
    qg = rope(q, rot_pos[:, :, None]).reshape(B, T, Hkv, Hq // Hkv, D).astype(f32) * D**-0.5
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, keys.astype(f32), precision=highest)
    behind = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, Hkv, T, S]
    seen = k_valid[:, :, None, :] & (behind >= 0) & (behind < window) & (jnp.arange(T) < lengths[:, None])[:, None, :, None]
    scores = jnp.where(seen[:, :, None], scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - jnp.where(jnp.isneginf(top), 0.0, top))
    total = e.sum(-1, keepdims=True)
    p = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)  # [B, Hkv, G, T, S]
    out = jnp.einsum("bhgts,bhsd->bthgd", p, values.astype(f32), precision=highest).reshape(B, T, Hq, D).astype(q.dtype)
    weights = policy.query_weights(lengths, T)
    if weights is None:
        return out, None
    reduce = jnp.max if policy.head_reduction == "max" else jnp.mean
    increments = reduce(jnp.einsum("bhgts,bt->bhgs", p, weights.astype(f32), precision=highest), axis=2)
    capacity = cached_k.shape[2]
    return out, cache_state.Scores(cache=increments[..., :capacity], chunk=increments[..., capacity:])


class CausalLM(nnx.Module):
    """A causal language model of one of the families above. `config` is static; weights are `nnx.Param`s."""

    def __init__(self, config: ModelConfig, weights: dict[str, jax.Array], *, mesh: jax.sharding.Mesh | None = None,
                 embed_spec=None, sliding_policy=None, kernels: Kernels | None = None):
        """weights by name (`models.weights`); mesh (with the embedding table's PartitionSpec `embed_spec`): the
        mesh the weights are placed on (`on_mesh` builds such models), which caches are then made on;
        sliding_policy: see `with_sliding_policy` (None: the trained window); kernels: see `with_kernels` (None:
        `Kernels.default()`, the platform's)."""
        if kernels is not None and not isinstance(kernels, Kernels):
            raise TypeError(f"kernels must be a jc.Kernels or None, got {type(kernels).__name__} {kernels!r}")
        expected = weight_shapes(config)
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            raise ValueError(f"weights do not match the config: missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(weights[name].shape)}, the config needs {shape}")
        if sliding_policy is not None:
            check_policy(sliding_policy)
            if not config.sliding_layers:
                raise ValueError("sliding_policy is for models with sliding-window layers (Gemma 3); this "
                                 f"{config.architecture} model has none")
            if sliding_policy.needs_prompt:
                raise ValueError(f"sliding_policy must act while tokens stream ({', '.join(policy_names(needs_prompt=False))}"
                                 f"), not after a prompt: got {type(sliding_policy).__name__}")
        self.config, self.sliding_policy = config, sliding_policy
        self.kernels = Kernels.default() if kernels is None else kernels
        self.mesh, self.embed_spec = mesh, embed_spec  # (`sharding.embed` looks tokens up by the spec)
        self.embed = nnx.Param(weights["embed"])
        self.final_norm = nnx.Param(weights["final_norm"])
        self.lm_head = nnx.Param(weights["lm_head"]) if "lm_head" in weights else None
        self.layers = nnx.Dict({name: nnx.Param(weights[name]) for name, w in declarations(config).items() if w.layer})

    @classmethod
    def random(cls, config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02,
               mesh: jax.sharding.Mesh | None = None, rules: dict[str, tuple] | None = None) -> CausalLM:
        """Random weights of the config's shapes (norms at 1), e.g. for speed measurements. With `mesh`,
        each device makes only its own shards (as `shard(..., rules)` places them): a model larger than one
        device."""
        shapes = weight_shapes(config)
        keys = dict(zip(shapes, jax.random.split(key, len(shapes))))

        def make(name: str) -> jax.Array:
            if name.endswith("norm"):
                return jnp.ones(shapes[name], dtype)
            return (scale * jax.random.normal(keys[name], shapes[name], jnp.float32)).astype(dtype)

        if mesh is None:
            return cls(config, {name: make(name) for name in shapes})
        return on_mesh(config, lambda shardings: {name: jax.jit(make, static_argnums=0, out_shardings=shardings[name])(name)
                                                  for name in shapes}, mesh, rules)

    @property
    def dtype(self):
        return self.embed[...].dtype

    def weights(self) -> dict[str, jax.Array]:
        """Every weight by name (the names and shapes of `weight_shapes`)."""
        weights = {"embed": self.embed[...], "final_norm": self.final_norm[...],
                   **{name: p[...] for name, p in self.layers.items()}}
        if self.lm_head is not None:
            weights["lm_head"] = self.lm_head[...]
        return weights

    def with_sliding_policy(self, policy) -> CausalLM:
        """This model (the same weights, mesh and config) with `policy` as the cache policy of its sliding-window
        layers, the one given to `generate`, `score` or `prefill` serving its global layers. Each sliding
        layer still sees only the keys of its trained window that its cache holds (so e.g. `jc.Sink`'s sinks
        drop out of the window once the text outgrows it); the policy runs with the global policy's stride,
        and must not act after a prompt (not `needs_prompt`). None: the exact trained window."""
        return self._with(sliding_policy=policy)

    def with_kernels(self, kernels: Kernels) -> CausalLM:
        """This model (the same weights, mesh and config) making its caches (`init_cache`, and so `generate`,
        `score` and `prefill`'s caches) with `kernels` (a `jc.Kernels`), which then run every attention and
        insertion of those caches."""
        return self._with(kernels=kernels)

    def _with(self, **changes) -> CausalLM:
        """This model with some of its construction arguments (mesh, embed_spec, sliding_policy, kernels) changed."""
        kept = dict(mesh=self.mesh, embed_spec=self.embed_spec, sliding_policy=self.sliding_policy, kernels=self.kernels)
        return CausalLM(self.config, self.weights(), **(kept | changes))

    def window_policy(self, policy):
        """The cache policy of the sliding layers with `policy`'s stride: `with_sliding_policy`'s, by default
        the model's window minus the query itself."""
        if self.sliding_policy is None:
            return SlidingWindow(window=self.config.sliding_window - 1, positions="original", stride=policy.stride)
        return dataclasses.replace(self.sliding_policy, stride=policy.stride)

    def init_cache(self, policy, batch: int, max_tokens: int | None = None):
        """An empty cache for every layer (leading layer axis), in the model's dtype, with the model's kernels; on a
        sharded model's mesh, rows over "data" and KV heads over "model". A model with sliding layers (Gemma 3) gets a pair:
        (`policy`'s cache of its global layers, the window cache of its sliding layers, `window_policy`)."""
        cfg = self.config
        sliding = len(cfg.sliding_layers)

        def make(policy, layers):
            state = cache_api.init_cache(policy, batch, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                     max_tokens=max_tokens, num_layers=layers, kernels=self.kernels)
            if self.mesh is None:
                return state
            return sharding.place(state, sharding.cache_specs(state, self.mesh), self.mesh)

        if not sliding:
            return make(policy, cfg.num_layers)
        return make(policy, cfg.num_layers - sliding), make(self.window_policy(policy), sliding)

    def layer_cache(self, state, layer: int) -> tuple[cache_state.CacheState, int]:
        """The stacked cache of `init_cache`'s `state` that holds model layer `layer` (an int), and the layer's
        index in it (its place among the layers of its type)."""
        sliding = self.config.sliding_layers
        if not sliding:
            return state, layer
        if layer in sliding:
            return state[1], sliding.index(layer)
        return state[0], layer - sum(1 for s in sliding if s < layer)

    def compress(self, policy, state, room: int):
        """`jcascade.compress` of the cache after a prompt (a policy with an observation window): of the global layers' cache only
        when the model has sliding layers."""
        if isinstance(state, tuple):
            return cache_api.compress(policy, state[0], room), state[1]
        return cache_api.compress(policy, state, room)

    def __call__(self, policy, state, tokens: jax.Array, lengths: jax.Array,
                 prefixes: tuple = ()) -> tuple[jax.Array, cache_state.CacheState]:
        """One chunk through all layers. tokens int32 [B, T]; lengths int32 [B] valid prefix per row;
        prefixes: `jcascade.SharedPrefix` levels (layers stacked) that the rows' histories begin with.
        Returns the final-norm hidden states [B, T, hidden] and the updated cache (`init_cache`'s). The attention
        runs on the cache's kernels (`CacheState.kernels`)."""
        cfg = self.config
        B, T = tokens.shape
        if prefixes and cfg.sliding_layers:
            raise ValueError("shared prefixes (num_samples) are not supported yet for models with sliding layers")
        x = sharding.embed(self.embed[...], tokens, self.mesh, self.embed_spec)
        if cfg.gemma:
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        layers = functools.partial(self._layers, lengths=lengths, prefixes=tuple(prefixes))
        branch = policy.step_branch(_layer_view(state[0] if isinstance(state, tuple) else state, jnp.int32(0)), T,
                                    lengths)
        if branch is None:
            x, state = layers(policy, x, state)
        else:
            index, branch_policies = branch
            x, state = jax.lax.switch(index, [functools.partial(layers, p) for p in branch_policies], x, state)
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.gemma), state

    def _layers(self, policy, x: jax.Array, state, *, lengths: jax.Array, prefixes: tuple) -> tuple[jax.Array, cache_state.CacheState]:
        """x [B, T, hidden] (embedded) through every layer under `lax.scan`; returns it and the cache. With
        sliding layers the scan's carry holds both caches and each layer picks its attention with `lax.cond`
        on its type, so each layer type compiles once."""
        cfg = self.config
        B, T = x.shape[:2]
        rope = cfg.rope
        weights = {name: p[...] for name, p in self.layers.items()}
        norm = functools.partial(rms_norm, eps=cfg.rms_norm_eps, gemma=cfg.gemma)
        scale = 1.0 if cfg.query_scale is None else cfg.query_scale * cfg.head_dim**0.5

        def attend_and_update(layer_state, q, k, v, lengths, layer_prefixes):
            if layer_prefixes:  # requests' own caches keep no scores under shared prefixes
                out, scores = shared.attend_shared(policy, layer_state, q, k, v, layer_prefixes, lengths, rope), None
            else:
                out, scores = cache_api.attend(policy, layer_state, q, k, v, lengths, rope)
            out, layer_state = _ordered(out, layer_state)
            return out, cache_api.update(policy, layer_state, k, v, scores, lengths)

        specs = None if self.mesh is None else sharding.layer_specs(
            state[0] if isinstance(state, tuple) else state, self.mesh, prefixes)
        if specs is not None:
            # every cache decision is per (row, KV head): each device runs attend and update (and so the
            # Pallas kernels) on its own rows and heads, with no communication
            attend_and_update = jax.shard_map(
                attend_and_update, mesh=self.mesh, check_vma=False,
                in_specs=(specs["state"], specs["chunk"], specs["chunk"], specs["chunk"], specs["lengths"],
                          specs["prefixes"]),
                out_specs=(specs["chunk"], specs["state"]))

        def global_layer(state, index, q, k, v, layer_prefixes):
            out, layer_state = attend_and_update(_layer_view(state, index), q, k, v, lengths, layer_prefixes)
            return out, _written_back(state, layer_state, index)

        window_policy = self.window_policy(policy) if cfg.sliding_layers else None

        def sliding_layer(state, index, q, k, v):
            layer_state = _layer_view(state, index)
            out, scores = window_attention(window_policy, layer_state, q, k, v, lengths, cfg.local_rope,
                                           cfg.sliding_window)
            (out, scores), layer_state = _ordered((out, scores), layer_state)
            layer_state = cache_api.update(window_policy, layer_state, k, v, scores, lengths)
            return out, _written_back(state, layer_state, index)

        def layer(carry, inputs):
            x, state = carry
            w, index, sliding, layer_prefixes = inputs
            h = norm(x, w["attn_norm"])
            # three views of h, as for the MLP below: XLA would merge the projections into one product over
            # [wq | wk | wv], concatenated anew in every layer of every step (1.1 ms of an 8B batch-16 step on an H100)
            h_q, h_k, h_v = jax.lax.optimization_barrier((h, h, h))
            q, k, v = h_q @ w["wq"], _product(h_k, w["wk"]), _product(h_v, w["wv"])
            if cfg.qkv_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
            k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
            if scale != 1.0:  # the attention scales by head_dim ** -0.5
                q = q * jnp.asarray(scale, q.dtype)
            if cfg.sliding_layers:
                def on_sliding(caches):
                    out, window_cache = sliding_layer(caches[1], index, q, k, v)
                    return out, (caches[0], window_cache)

                def on_global(caches):
                    out, global_cache = global_layer(caches[0], index, q, k, v, layer_prefixes)
                    return out, (global_cache, caches[1])

                out, state = jax.lax.cond(sliding, on_sliding, on_global, state)
            else:
                out, state = global_layer(state, index, q, k, v, layer_prefixes)
            o = out.reshape(B, T, -1) @ w["wo"]
            o = o + w["bo"] if cfg.o_bias else o
            x = x + (norm(o, w["post_attn_norm"]) if cfg.gemma else o)
            h = norm(x, w["mlp_norm"])
            # two views of h: XLA would merge the two products into one over [w_gate | w_up], concatenated
            # anew every step (a copy of both weights: 1.8 ms of a TP=2 8B decode step on two H200s)
            h_gate, h_up = jax.lax.optimization_barrier((h, h))
            gate = jax.nn.gelu(h_gate @ w["w_gate"], approximate=True) if cfg.gemma else jax.nn.silu(h_gate @ w["w_gate"])
            m = (gate * (h_up @ w["w_up"])) @ w["w_down"]
            x = x + (norm(m, w["post_mlp_norm"]) if cfg.gemma else m)
            return (x, state), None

        sliding = jnp.asarray([i in cfg.sliding_layers for i in range(cfg.num_layers)])
        index = jnp.cumsum(jnp.where(sliding, 1, 0)) - 1  # each layer's place among the layers of its type
        index = jnp.where(sliding, index, jnp.arange(cfg.num_layers) - index - 1).astype(jnp.int32)
        (x, state), _ = jax.lax.scan(layer, (x, state), (weights, index, sliding, prefixes))
        return x, state

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 [..., vocab] from final hidden states [..., hidden]."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        # one row would be a matrix-vector product, which XLA on GPUs runs by first converting the whole head to
        # float32 (1 ms of an 8B batch-1 decode step on an H200): `_product` keeps one bf16 product
        return _product(hidden, head, jnp.float32)


def _product(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N]. A single row is doubled: XLA on GPUs rewrites a one-row product into multiply and
    reduce fusions (the k and v projections of an 8B batch-1 decode step: 1.1 ms on an H100, 0.5 ms as cuBLAS
    products) or, for a float32 result, converts the weights first; two rows keep one cuBLAS product."""
    rows = x.reshape(-1, x.shape[-1])
    padded = jnp.concatenate([rows, rows]) if rows.shape[0] == 1 else rows
    out = jnp.dot(padded, w, preferred_element_type=preferred_element_type)[: rows.shape[0]]
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _layer_view(state: cache_state.CacheState, index: jax.Array) -> cache_state.CacheState:
    """Layer `index`'s view of the stacked cache: the whole K/V stack with its layer index, its own small arrays."""
    return dataclasses.replace(state, score=state.score[index], pos=state.pos[index], seen=state.seen[index], layer=index)


def _written_back(state: cache_state.CacheState, layer_state: cache_state.CacheState, index: jax.Array) -> cache_state.CacheState:
    """The stacked cache after a layer's update: its K/V stack (written in place) and its small arrays set at
    `index`."""
    return dataclasses.replace(layer_state, score=state.score.at[index].set(layer_state.score),
                               pos=state.pos.at[index].set(layer_state.pos),
                               seen=state.seen.at[index].set(layer_state.seen), layer=None)


def _ordered(out: jax.Array, state: cache_state.CacheState) -> tuple[jax.Array, cache_state.CacheState]:
    """(out, state) as one value: every read of the K/V stack by the attention that made `out` precedes the
    update's in-place writes to `state`, and nothing downstream recomputes `out` from the stack (else XLA
    copies the stack to keep an unordered read valid; tests/models/test_decoder.py)."""
    return jax.lax.optimization_barrier((out, state))


def shard(model: CausalLM, mesh: jax.sharding.Mesh, rules: dict[str, tuple] | None = None) -> CausalLM:
    """The model with its weights placed on `mesh` (axes ("data", "model")) by their logical axes
    (`models.weights`, mapped by `sharding.LOGICAL_RULES`), or per weight name by `rules` (mesh axes); its
    caches (`init_cache`, and so `generate`, `score`, `prefill`) get rows over "data" and KV heads over "model"."""
    return on_mesh(model.config, model.weights(), mesh, rules)._with(sliding_policy=model.sliding_policy,
                                                                     kernels=model.kernels)


def on_mesh(config: ModelConfig, weights, mesh: jax.sharding.Mesh, rules: dict[str, tuple] | None = None) -> CausalLM:
    """A model whose weights go straight to their shards on `mesh` (see `shard`). weights: arrays by name
    (device or host), or a function of {name: NamedSharding} returning them so placed (a sharded restore)."""
    specs = sharding.weight_specs(config, mesh, rules)
    shardings = {name: jax.sharding.NamedSharding(mesh, specs[name]) for name in weight_shapes(config)}
    placed = weights(shardings) if callable(weights) else \
        {name: jax.device_put(w, shardings[name]) for name, w in weights.items()}
    return CausalLM(config, placed, mesh=mesh, embed_spec=specs["embed"])
