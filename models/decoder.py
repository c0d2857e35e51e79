"""The decoder of every family in `config.ARCHITECTURES` as a Flax NNX module, attention delegated to jcascade's
cache policies.

These architectures share this decoder: pre-norm blocks of RMSNorm, grouped-query attention with rotary
positions (Qwen2 adds q/k/v biases, Qwen3 an RMSNorm of each head's q and k), and a SwiGLU MLP; Gemma 3 adds
(1 + w) norms after attention and MLP too, a GeLU-tanh MLP, scaled embeddings, and sliding-window layers with a
window cache of their own (`window_attention`; `with_sliding_policy` sets its policy) beside the global ones.
Gemma 4 gives the global layers a head_dim and KV heads of their own, lets later layers read an earlier layer's
cache, and adds per-layer inputs and soft-capped logits; Qwen3.5 interleaves Gated DeltaNet layers with a
fixed-size recurrent state (`delta_net`) and gated, partially rotated full-attention layers. Its weights are
declared in `models.weights`. The L layers' weights are stacked on a leading axis and run under `lax.scan`, each
layer type's mixer under `lax.switch`, so a model compiles as one layer of each type whatever its depth. Each
attention layer calls
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
from jcascade.models import delta_net, sharding
from jcascade.models.config import GLOBAL, LINEAR, SLIDING, ModelConfig
from jcascade.models.weights import declarations, weight_shapes
from jcascade.pallas_kernels import Kernels

from jcascade import cache_api, cache_state, shared
from jcascade.policies import SlidingWindow, check_policy, policy_names


def rms_norm(
    x: jax.Array, weight: jax.Array | None, eps: float, plus_one: bool = False, scale_f32: bool = False
) -> jax.Array:
    """As Hugging Face: normalise in float32, cast back, then scale by weight (Llama); with `plus_one` (Gemma 3,
    Qwen3.5), scale by (1 + weight) in float32, with `scale_f32` (Gemma 4) by weight in float32, then cast back;
    weight None: no scale (Gemma 4's value norm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is None:
        return xf.astype(x.dtype)
    if plus_one or scale_f32:
        return (xf * (plus_one + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def window_attention(
    policy,
    state: cache_state.CacheState,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    rope,
    window: int,
) -> tuple[jax.Array, cache_state.Scores | None]:
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
    chunk = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, H, D] -> [B, H, T, D]
    keys = jnp.concatenate([rope(cached_k, key_pos), chunk(rope(k, rot_pos[:, :, None]))], axis=2)
    values = jnp.concatenate([cached_v, chunk(v)], axis=2)
    k_pos = jnp.concatenate([state.pos, jnp.broadcast_to(q_pos[:, None, :], (B, Hkv, T))], axis=2)  # [B, Hkv, S]
    k_valid = jnp.concatenate(
        [state.pos >= 0, jnp.broadcast_to((jnp.arange(T) < lengths[:, None])[:, None, :], (B, Hkv, T))], axis=2
    )
    qg = rope(q, rot_pos[:, :, None]).reshape(B, T, Hkv, Hq // Hkv, D).astype(f32) * D**-0.5
    scores = jnp.einsum("bthgd,bhsd->bhgts", qg, keys.astype(f32), precision=highest)
    behind = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, Hkv, T, S]
    seen = (
        k_valid[:, :, None, :]
        & (behind >= 0)
        & (behind < window)
        & (jnp.arange(T) < lengths[:, None])[:, None, :, None]
    )
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

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, jax.Array],
        *,
        mesh: jax.sharding.Mesh | None = None,
        embed_spec=None,
        sliding_policy=None,
        kernels: Kernels | None = None,
    ):
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
                raise ValueError(
                    "sliding_policy is for models with sliding-window layers (Gemma 3); this "
                    f"{config.architecture} model has none"
                )
            if sliding_policy.needs_prompt:
                raise ValueError(
                    f"sliding_policy must act while tokens stream ({', '.join(policy_names(needs_prompt=False))}"
                    f"), not after a prompt: got {type(sliding_policy).__name__}"
                )
            if sliding_policy.kv_dtype != "model":
                raise ValueError(
                    f"sliding_policy's kv_dtype must be 'model', got {sliding_policy.kv_dtype!r}: the "
                    "sliding layers store the format of the policy the model runs under (its kv_dtype)"
                )
        self.config, self.sliding_policy = config, sliding_policy
        self.kernels = Kernels.default() if kernels is None else kernels
        self.mesh, self.embed_spec = mesh, embed_spec  # (`sharding.embed` looks tokens up by the spec)
        self.embed = nnx.Param(weights["embed"])
        self.final_norm = nnx.Param(weights["final_norm"])
        self.lm_head = nnx.Param(weights["lm_head"]) if "lm_head" in weights else None
        self.layers = nnx.Dict({name: nnx.Param(weights[name]) for name, w in declarations(config).items() if w.layer})
        # Gemma 4's per-layer input table, projection and norm
        self.per_layer_inputs = nnx.Dict(
            {
                name: nnx.Param(weights[name])
                for name, w in declarations(config).items()
                if not w.layer and name not in ("embed", "final_norm", "lm_head")
            }
        )

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        key: jax.Array,
        dtype=jnp.float32,
        scale: float = 0.02,
        mesh: jax.sharding.Mesh | None = None,
        rules: dict[str, tuple] | None = None,
    ) -> CausalLM:
        """Random weights of the config's shapes (norms at 1), e.g. for speed measurements. With `mesh`,
        each device makes only its own shards (as `shard(..., rules)` places them): a model larger than one
        device."""
        shapes, declared = weight_shapes(config), declarations(config)
        # a key per stored tensor, a fused weight's parts apart: a key gives the weights it gave before they were joined
        drawn = [part for name, w in declared.items() for part in ([p for p, _ in w.parts] or [name])]
        keys = dict(zip(drawn, jax.random.split(key, len(drawn))))

        def draw(name: str, shape: tuple[int, ...]) -> jax.Array:
            return (scale * jax.random.normal(keys[name], shape, jnp.float32)).astype(dtype)

        def make(name: str) -> jax.Array:
            if name.endswith("norm"):
                return jnp.ones(shapes[name], dtype)
            w = declared[name]
            if w.parts:
                layers = (len(w.layer_indices(config)),) if w.layer else ()
                return w.join(config, [draw(p, layers + part.shape(config)) for p, part in w.parts], xp=jnp)
            return draw(name, shapes[name])

        if mesh is None:
            return cls(config, {name: make(name) for name in shapes})
        return on_mesh(
            config,
            lambda shardings: {
                name: jax.jit(make, static_argnums=0, out_shardings=shardings[name])(name) for name in shapes
            },
            mesh,
            rules,
        )

    @property
    def dtype(self):
        return self.embed[...].dtype

    def weights(self) -> dict[str, jax.Array]:
        """Every weight by name (the names and shapes of `weight_shapes`)."""
        weights = {
            "embed": self.embed[...],
            "final_norm": self.final_norm[...],
            **{name: p[...] for name, p in self.layers.items()},
            **{name: p[...] for name, p in self.per_layer_inputs.items()},
        }
        if self.lm_head is not None:
            weights["lm_head"] = self.lm_head[...]
        return weights

    def with_sliding_policy(self, policy) -> CausalLM:
        """This model (the same weights, mesh and config) with `policy` as the cache policy of its sliding-window
        layers, the one given to `generate`, `score` or `prefill` serving its global layers. Each sliding
        layer still sees only the keys of its trained window that its cache holds (so e.g. `jc.Sink`'s sinks
        drop out of the window once the text outgrows it); the policy runs with the global policy's stride and
        storage format (its own kv_dtype must be "model"), and must not act after a prompt (not `needs_prompt`).
        None: the exact trained window."""
        return self._with(sliding_policy=policy)

    def with_kernels(self, kernels: Kernels) -> CausalLM:
        """This model (the same weights, mesh and config) making its caches (`init_cache`, and so `generate`,
        `score` and `prefill`'s caches) with `kernels` (a `jc.Kernels`), which then run every attention and
        insertion of those caches."""
        return self._with(kernels=kernels)

    def _with(self, **changes) -> CausalLM:
        """This model with some of its construction arguments (mesh, embed_spec, sliding_policy, kernels) changed."""
        kept = dict(
            mesh=self.mesh, embed_spec=self.embed_spec, sliding_policy=self.sliding_policy, kernels=self.kernels
        )
        return CausalLM(self.config, self.weights(), **(kept | changes))

    def window_policy(self, policy):
        """The cache policy of the sliding layers with `policy`'s stride and storage format (`kv_dtype`: every
        attention cache of a model stores one format): `with_sliding_policy`'s, by default the model's window
        minus the query itself."""
        same = dict(stride=policy.stride, kv_dtype=policy.kv_dtype)
        if self.sliding_policy is None:
            return SlidingWindow(window=self.config.sliding_window - 1, positions="original", **same)
        return dataclasses.replace(self.sliding_policy, **same)

    def init_cache(self, policy, batch: int, max_tokens: int | None = None):
        """An empty state for every layer, in the model's dtype, with the model's kernels; on a sharded model's mesh,
        rows over "data" and KV heads over "model". One stack per layer type with a state (`ModelConfig.state_types`,
        leading axis over its layers that keep one): `policy`'s cache of the global layers, the window cache of the
        sliding ones (`window_policy`), the recurrent states of the linear ones (`delta_net.LinearState`, rows over
        "data"). A model of global layers alone gets its cache; others a tuple in that order (global first)."""
        cfg = self.config

        def make(layer_type):
            layers = len(cfg.layers_with_state(layer_type))
            if layer_type == LINEAR:
                state = delta_net.init_linear_state(
                    batch,
                    num_value_heads=cfg.linear_value_heads,
                    key_dim=cfg.linear_key_dim,
                    value_dim=cfg.linear_value_dim,
                    conv_channels=2 * cfg.linear_key_heads * cfg.linear_key_dim
                    + cfg.linear_value_heads * cfg.linear_value_dim,
                    kernel=cfg.linear_conv_kernel,
                    dtype=self.dtype,
                    num_layers=layers,
                )
                specs = None if self.mesh is None else sharding.linear_state_specs(state, self.mesh)
            else:
                state = cache_api.init_cache(
                    policy if layer_type == GLOBAL else self.window_policy(policy),
                    batch,
                    cfg.kv_heads(layer_type),
                    cfg.head_size(layer_type),
                    self.dtype,
                    max_tokens=max_tokens,
                    num_layers=layers,
                    kernels=self.kernels,
                )
                specs = None if self.mesh is None else sharding.cache_specs(state, self.mesh)
            return state if specs is None else sharding.place(state, specs, self.mesh)

        states = tuple(make(t) for t in cfg.state_types)
        return states if len(states) > 1 else states[0]

    def layer_cache(self, state, layer: int) -> tuple[cache_state.CacheState, int]:
        """The stacked cache of `init_cache`'s `state` that model layer `layer` (an int) attends to, and that
        cache's index in it (a layer reading an earlier layer's cache gets that one). A ValueError for a linear
        layer (it keeps no KV cache)."""
        cfg = self.config
        layer_type = cfg.types[layer]
        if layer_type == LINEAR:
            raise ValueError(f"layer {layer} is a linear-attention layer: it keeps a recurrent state, no KV cache")
        stack = dict(zip(cfg.state_types, state if isinstance(state, tuple) else (state,)))[layer_type]
        return stack, cfg.layers_with_state(layer_type).index(cfg.reads_from(layer))

    def compress(self, policy, state, room: int):
        """`jcascade.compress` of the cache after a prompt (a policy with an observation window): of the global
        layers' cache (the other layer types' states are kept as they are)."""
        if isinstance(state, tuple):
            return cache_api.compress(policy, state[0], room), *state[1:]
        return cache_api.compress(policy, state, room)

    def _norm(self, x: jax.Array, weight: jax.Array | None) -> jax.Array:
        cfg = self.config
        f = cfg.features
        return rms_norm(x, weight, cfg.rms_norm_eps, plus_one=f.norm_plus_one, scale_f32=f.norm_scale_f32)

    def __call__(
        self, policy, state, tokens: jax.Array, lengths: jax.Array, prefixes: tuple = ()
    ) -> tuple[jax.Array, cache_state.CacheState]:
        """One chunk through all layers. tokens int32 [B, T]; lengths int32 [B] valid prefix per row;
        prefixes: `jcascade.SharedPrefix` levels (layers stacked) that the rows' histories begin with.
        Returns the final-norm hidden states [B, T, hidden] and the updated state (`init_cache`'s). The attention
        runs on the cache's kernels (`CacheState.kernels`)."""
        cfg = self.config
        if prefixes and (cfg.state_types != (GLOBAL,) or cfg.kv_shared_layers or cfg.nope_layers):
            raise ValueError(
                "shared prefixes (num_samples, context=) are not supported for models with sliding or "
                "linear layers, shared caches or layers without rotary positions (Gemma 3 and 4, Qwen3.5, SmolLM3)"
            )
        x = sharding.embed(self.embed[...], tokens, self.mesh, self.embed_spec)
        if cfg.features.embed_scaled:
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        per_layer = self._per_layer_inputs(tokens, x) if cfg.per_layer_input_size else None
        layers = functools.partial(self._layers, lengths=lengths, prefixes=tuple(prefixes), per_layer=per_layer)
        branch = policy.step_branch(
            _layer_view(state[0] if isinstance(state, tuple) else state, jnp.int32(0)), tokens.shape[1], lengths
        )
        if branch is None:
            x, state = layers(policy, x, state)
        else:
            index, branch_policies = branch
            x, state = jax.lax.switch(index, [functools.partial(layers, p) for p in branch_policies], x, state)
        return self._norm(x, self.final_norm[...]), state

    def _per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """Gemma 4's per-layer inputs [L, B, T, P] for tokens [B, T] with embeddings x [B, T, hidden] (scaled): a
        table lookup (scaled by sqrt(P)) and a normed projection of x (scaled by hidden ** -0.5), averaged (sum /
        sqrt(2))."""
        cfg = self.config
        B, T = tokens.shape
        L, P = cfg.num_layers, cfg.per_layer_input_size
        table = self.per_layer_inputs["embed_per_layer"][...]
        looked_up = jnp.take(table, tokens, axis=0) * jnp.asarray(P**0.5, table.dtype)
        projected = (x @ self.per_layer_inputs["per_layer_projection"][...]) * jnp.asarray(
            cfg.hidden_size**-0.5, x.dtype
        )
        projected = self._norm(projected.reshape(B, T, L, P), self.per_layer_inputs["per_layer_projection_norm"][...])
        combined = (projected + looked_up.reshape(B, T, L, P)) * jnp.asarray(2**-0.5, x.dtype)
        return combined.transpose(2, 0, 1, 3)

    def _layers(
        self, policy, x: jax.Array, state, *, lengths: jax.Array, prefixes: tuple, per_layer: jax.Array | None
    ) -> tuple[jax.Array, cache_state.CacheState]:
        """x [B, T, hidden] (embedded) through every layer under `lax.scan`; returns it and the cache. Each layer
        runs the mixer of its type and role (`_mixers`) under `lax.switch`, so each compiles once; the states of
        all types ride in the scan's carry. per_layer: Gemma 4's per-layer inputs [L, B, T, P] (or None)."""
        cfg = self.config
        decl = declarations(cfg)
        weights = {name: p[...] for name, p in self.layers.items()}
        scanned = {name: w for name, w in weights.items() if decl[name].layers == "all"}
        stacks = {name: w for name, w in weights.items() if decl[name].layers != "all"}
        ranks = {}  # each layer's place in the stack of each layer set (0 where it has none)
        for name in stacks:
            held = decl[name].layer_indices(cfg)
            ranks[decl[name].layers] = jnp.asarray(
                [held.index(i) if i in held else 0 for i in range(cfg.num_layers)], jnp.int32
            )
        norm = self._norm
        states = dict(zip(cfg.state_types, state if isinstance(state, tuple) else (state,)))
        mixers, pending = self._mixers(policy, states, x, lengths, prefixes)
        roles = [_role(cfg, i) for i in range(cfg.num_layers)]
        branch = jnp.asarray([list(mixers).index(r) for r in roles], jnp.int32)
        slot = jnp.asarray(
            [cfg.layers_with_state(t).index(cfg.reads_from(i)) for i, (t, _, _) in enumerate(roles)], jnp.int32
        )  # the state a layer reads, in its type's stack
        f = cfg.features

        def layer(carry, inputs):
            x, states, pending = carry
            w, rank, branch_index, index, layer_prefixes, extra = inputs
            fetch = lambda name: w[name] if name in w else stacks[name][rank[decl[name].layers]]
            h = norm(x, w["attn_norm"]) if f.pre_norms else x
            o, states, pending = jax.lax.switch(
                branch_index,
                [functools.partial(m, fetch) for m in mixers.values()],
                h,
                states,
                pending,
                index,
                layer_prefixes,
            )
            x = x + (norm(o, w["post_attn_norm"]) if f.post_norms else o)
            h = norm(x, w["mlp_norm"]) if f.pre_norms else x
            gate_up = jnp.einsum("btd,dci->btci", h, w["w_gate_up"])  # [in, 2, intermediate] (models.weights.FUSED)
            gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
            act = functools.partial(jax.nn.gelu, approximate=True) if f.activation == "gelu_tanh" else jax.nn.silu
            m = (act(gate) * up) @ w["w_down"]
            x = x + (norm(m, w["post_mlp_norm"]) if f.post_norms else m)
            if extra is not None:  # Gemma 4's per-layer input
                g = jax.nn.gelu(x @ w["ple_gate"], approximate=True) * extra
                x = x + norm(g @ w["ple_proj"], w["ple_norm"])
            if "layer_scalar" in w:
                x = x * w["layer_scalar"].astype(x.dtype)
            return (x, states, pending), None

        (x, states, pending), _ = jax.lax.scan(
            layer, (x, states, pending), (scanned, ranks, branch, slot, prefixes, per_layer)
        )
        for layer_type, (k, v, scores) in pending.items():  # the cache that later layers read, updated last
            index = cfg.layers_with_state(layer_type).index(
                next(i for i, r in enumerate(roles) if r[:2] == (layer_type, "store"))
            )
            layer_policy = policy if layer_type == GLOBAL else self.window_policy(policy)
            view = _layer_view(states[layer_type], jnp.int32(index))
            states[layer_type] = _written_back(
                states[layer_type], cache_api.update(layer_policy, view, k, v, scores, lengths), jnp.int32(index)
            )
        out = tuple(states[t] for t in cfg.state_types)
        return x, out if len(out) > 1 else out[0]

    def _mixers(self, policy, states: dict, x: jax.Array, lengths: jax.Array, prefixes: tuple):
        """The token mixers of the model's layers by role (`_role`: a layer type, "own" for a layer with a state of
        its own, "store" for one whose cache later layers read, "read" for those, and whether it rotates), each
        `mixer(fetch, h, states, pending, index, layer_prefixes) -> (out [B, T, hidden], states, pending)`: `fetch`
        gives the layer's weights by name, `index` is its state's place in its type's stack. A "store" layer
        attends and leaves its chunk's keys, values and scores in `pending` (by layer type); its update is applied
        after every layer has read that cache (`_layers`). Returns ({role: mixer}, the initial pending)."""
        cfg = self.config
        B, T = x.shape[:2]
        window_policy = self.window_policy(policy) if SLIDING in cfg.types else None
        fused_qkv = "wqkv" in self.layers  # models.weights.FUSED: every family but Gemma 4
        specs = None if self.mesh is None else sharding.layer_specs(states[GLOBAL], self.mesh, prefixes)

        norm = self._norm

        def rope_of(layer_type, rotary):  # None: no rotation (`nope_layers`, global layers only)
            return None if not rotary else cfg.local_rope if layer_type == SLIDING else cfg.rope

        def attend(layer_type, rope, view, q, k, v, lengths, layer_prefixes):
            if layer_type == SLIDING:
                return window_attention(window_policy, view, q, k, v, lengths, rope, cfg.sliding_window)
            if layer_prefixes:  # requests' own caches keep no scores under shared prefixes
                return shared.attend_shared(policy, view, q, k, v, layer_prefixes, lengths, rope), None
            return cache_api.attend(policy, view, q, k, v, lengths, rope)

        def attend_and_update(layer_type, rope, view, q, k, v, lengths, layer_prefixes):
            out, view = _ordered(attend(layer_type, rope, view, q, k, v, lengths, layer_prefixes), view)
            return out[0], cache_api.update(
                policy if layer_type == GLOBAL else window_policy, view, k, v, out[1], lengths
            )

        def attend_and_update_of(layer_type, rope):
            update = functools.partial(attend_and_update, layer_type, rope)
            if layer_type != GLOBAL or specs is None:
                return update
            # every cache decision is per (row, KV head): each device runs attend and update (and so the
            # Pallas kernels) on its own rows and heads (all of an axis that does not divide), with no communication
            return jax.shard_map(
                update,
                mesh=self.mesh,
                check_vma=False,
                in_specs=(
                    specs["state"],
                    specs["chunk"],
                    specs["chunk"],
                    specs["chunk"],
                    specs["lengths"],
                    specs["prefixes"],
                ),
                out_specs=(specs["chunk"], specs["state"]),
            )

        def weight_suffix(layer_type):  # the global layers' attention weights of their own (models.weights)
            return "_global" if layer_type == GLOBAL and cfg.features.global_attention_weights else ""

        def qk_norm(x, weight):  # x [B, T, heads, D]: each head's features normed, or all heads' at once
            if not cfg.features.qk_norm_full:
                return norm(x, weight)
            return norm(x.reshape(*x.shape[:2], -1), weight).reshape(x.shape)

        def projections(layer_type, fetch, h, with_kv: bool):
            """q [B, T, H, D] (un-rotated; scaled for the kernels' D ** -0.5), the output gate (None without one),
            and with_kv k, v [B, T, Hkv, D] (un-rotated; else None, None) of an attention layer of `layer_type`,
            from its input h [B, T, hidden]."""
            suffix = weight_suffix(layer_type)
            D, H, Hkv = cfg.head_size(layer_type), cfg.num_heads, cfg.kv_heads(layer_type)
            # a view of h of its own for the gate: XLA would merge the two products into one over [wq | gate],
            # concatenated anew in every layer of every step
            h, h_gate = jax.lax.optimization_barrier((h, h)) if cfg.attention_output_gate else (h, None)
            if fused_qkv:  # [in, Hkv, H / Hkv + 2, D]: each KV head's queries, key and value (models.weights.FUSED)
                qkv = jnp.einsum("btd,dhgk->bthgk", h, fetch("wqkv"))
                q, k, v = qkv[:, :, :, :-2].reshape(B, T, H, D), qkv[:, :, :, -2], qkv[:, :, :, -1]
            else:  # Gemma 4: later layers read an earlier layer's k and v
                # a view of h for each: XLA would merge the projections into one product over [wq | wk | wv],
                # concatenated anew in every layer of every step
                h, h_k, h_v = jax.lax.optimization_barrier((h, h, h))
                q = (h @ fetch("wq" + suffix)).reshape(B, T, H, D)
                k = v = None
                if with_kv:
                    k = (h_k @ fetch("wk" + suffix)).reshape(B, T, Hkv, D)
                    v = k if cfg.k_eq_v and layer_type == GLOBAL else (h_v @ fetch("wv" + suffix)).reshape(B, T, Hkv, D)
            if cfg.qkv_bias:
                q = q + fetch("bq").reshape(H, D)
                if with_kv:
                    k, v = k + fetch("bk").reshape(Hkv, D), v + fetch("bv").reshape(Hkv, D)
            q = qk_norm(q, fetch("q_norm" + suffix)) if cfg.qk_norm else q
            gate = h_gate @ fetch("w_attn_gate") if cfg.attention_output_gate else None
            scale = 1.0 if cfg.query_scale is None else cfg.query_scale * D**0.5
            if scale != 1.0:  # the attention scales by head_dim ** -0.5
                q = q * jnp.asarray(scale, q.dtype)
            if not with_kv:
                return _rotary_order(cfg, layer_type, q), gate, None, None
            k = qk_norm(k, fetch("k_norm" + suffix)) if cfg.qk_norm else k
            if cfg.features.value_norm:
                v = norm(v, None)
            return _rotary_order(cfg, layer_type, q), gate, _rotary_order(cfg, layer_type, k), v

        def output(fetch, layer_type, out, gate):
            suffix = weight_suffix(layer_type)
            out = out.reshape(B, T, -1)
            if gate is not None:
                out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
            o = out @ fetch("wo" + suffix)
            return o + fetch("bo") if cfg.o_bias else o

        def own(layer_type, rope):
            update = attend_and_update_of(layer_type, rope)

            def mixer(fetch, h, states, pending, index, layer_prefixes):
                q, gate, k, v = projections(layer_type, fetch, h, with_kv=True)
                out, view = update(_layer_view(states[layer_type], index), q, k, v, lengths, layer_prefixes)
                return (
                    output(fetch, layer_type, out, gate),
                    {**states, layer_type: _written_back(states[layer_type], view, index)},
                    pending,
                )

            return mixer

        def store(layer_type, rope):
            def mixer(fetch, h, states, pending, index, layer_prefixes):
                q, gate, k, v = projections(layer_type, fetch, h, with_kv=True)
                out, scores = attend(
                    layer_type, rope, _layer_view(states[layer_type], index), q, k, v, lengths, layer_prefixes
                )
                return output(fetch, layer_type, out, gate), states, {**pending, layer_type: (k, v, scores)}

            return mixer

        def read(layer_type, rope):
            def mixer(fetch, h, states, pending, index, layer_prefixes):
                q, gate, _, _ = projections(layer_type, fetch, h, with_kv=False)
                k, v, _ = pending[layer_type]
                view = _layer_view(states[layer_type], index)
                out, _ = attend(layer_type, rope, view, q, k, v, lengths, layer_prefixes)
                return output(fetch, layer_type, out, gate), states, pending

            return mixer

        def linear(fetch, h, states, pending, index, layer_prefixes):
            w = {
                name: fetch(name)
                for name in (
                    "lin_qkv",
                    "lin_z",
                    "lin_b",
                    "lin_a",
                    "lin_conv",
                    "lin_dt_bias",
                    "lin_a_log",
                    "lin_norm",
                    "lin_out",
                )
            }
            view = jax.tree.map(lambda a: a[index], states[LINEAR])
            out, view = delta_net.gated_delta_net(
                w,
                h,
                view,
                lengths,
                num_key_heads=cfg.linear_key_heads,
                num_value_heads=cfg.linear_value_heads,
                key_dim=cfg.linear_key_dim,
                value_dim=cfg.linear_value_dim,
                eps=cfg.rms_norm_eps,
            )
            written = jax.tree.map(lambda a, b: a.at[index].set(b), states[LINEAR], view)
            return out, {**states, LINEAR: written}, pending

        roles = dict.fromkeys(_role(cfg, i) for i in range(cfg.num_layers))
        build = {"own": own, "store": store, "read": read}
        mixers = {(t, r, o): linear if t == LINEAR else build[r](t, rope_of(t, o)) for t, r, o in roles}
        pending = {}
        for t, r, o in roles:
            if r == "store":  # zeros of its chunk's keys, values and scores, carried through the layers before it
                D, Hkv = cfg.head_size(t), cfg.kv_heads(t)
                q = jax.ShapeDtypeStruct((B, T, cfg.num_heads, D), x.dtype)
                kv = jax.ShapeDtypeStruct((B, T, Hkv, D), x.dtype)
                view = _layer_view(states[t], jnp.int32(0))
                scores = jax.eval_shape(
                    lambda q, k, v: attend(t, rope_of(t, o), view, q, k, v, lengths, ())[1], q, kv, kv
                )
                pending[t] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (kv, kv, scores))
        return mixers, pending

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 [..., vocab] from final hidden states [..., hidden] (Gemma 4: soft-capped, cap * tanh(x / cap))."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        logits = _float32_product(hidden, head)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _role(cfg: ModelConfig, layer: int) -> tuple[str, str, bool]:
    """(layer type, role, rotary): role "own" for a layer with a state of its own, "store" for one whose cache later
    layers read (`ModelConfig.reads_from`), "read" for those; rotary: whether its attention rotates q and k (not
    one of `ModelConfig.nope_layers`)."""
    layer_type, rotary = cfg.types[layer], layer not in cfg.nope_layers
    if cfg.reads_from(layer) != layer:
        return layer_type, "read", rotary
    readers = any(cfg.reads_from(i) == layer for i in range(layer + 1, cfg.num_layers))
    return layer_type, "store" if readers else "own", rotary


def _rotary_order(cfg: ModelConfig, layer_type: str, x: jax.Array) -> jax.Array:
    """x [..., D] (queries or keys) with a global layer's partially rotated head dims (Qwen3.5: the first r = D *
    partial_rotary_factor dims rotate in pairs (i, i + r/2)) moved to the rotate-half pairs (i, i + D/2) that
    the kernels rotate (`ModelConfig.rope` gives the other pairs frequency 0); the attention's q . k is unchanged
    by the same order on both. Other layers: x."""
    if cfg.features.rope_proportional or layer_type != GLOBAL or cfg.partial_rotary_factor == 1:
        return x
    D = x.shape[-1]
    r = int(D * cfg.partial_rotary_factor)
    rest = list(range(r, D))
    half = D // 2 - r // 2
    order = list(range(r // 2)) + rest[:half] + list(range(r // 2, r)) + rest[half:]
    return x[..., jnp.asarray(order)]


def _float32_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 x [..., K] @ w [K, N] of bf16 (or other) operands. A single row is doubled: XLA on GPUs runs a
    one-row product with a float32 result by first converting the whole weight to float32 (about 1 ms of an 8B
    batch-1 decode step on an H200, 1.3 ms on an H100, for the head's 1 GB); two rows keep one cuBLAS product of
    the weight as it is."""
    rows = x.reshape(-1, x.shape[-1])
    padded = jnp.concatenate([rows, rows]) if rows.shape[0] == 1 else rows
    out = jnp.dot(padded, w, preferred_element_type=jnp.float32)[: rows.shape[0]]
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _layer_view(state: cache_state.CacheState, index: jax.Array) -> cache_state.CacheState:
    """Layer `index`'s view of the stacked cache: the whole K/V stack with its layer index, its own small arrays."""
    return dataclasses.replace(
        state, layer=index, **{name: getattr(state, name)[index] for name in cache_state.layer_fields(state)}
    )


def _written_back(
    state: cache_state.CacheState, layer_state: cache_state.CacheState, index: jax.Array
) -> cache_state.CacheState:
    """The stacked cache after a layer's update: its K/V stack (written in place) and its small arrays set at
    `index`."""
    return dataclasses.replace(
        layer_state,
        layer=None,
        **{
            name: getattr(state, name).at[index].set(getattr(layer_state, name))
            for name in cache_state.layer_fields(state)
        },
    )


def _ordered(out: jax.Array, state: cache_state.CacheState) -> tuple[jax.Array, cache_state.CacheState]:
    """(out, state) as one value: every read of the K/V stack by the attention that made `out` precedes the
    update's in-place writes to `state`, and nothing downstream recomputes `out` from the stack (else XLA
    copies the stack to keep an unordered read valid; tests/models/test_decoder.py)."""
    return jax.lax.optimization_barrier((out, state))


def shard(model: CausalLM, mesh: jax.sharding.Mesh, rules: dict[str, tuple] | None = None) -> CausalLM:
    """The model with its weights placed on `mesh` (axes ("data", "model")) by their logical axes
    (`models.weights`, mapped by `sharding.LOGICAL_RULES`), or per weight name by `rules` (mesh axes); its
    caches (`init_cache`, and so `generate`, `score`, `prefill`) get rows over "data" and KV heads over "model"."""
    return on_mesh(model.config, model.weights(), mesh, rules)._with(
        sliding_policy=model.sliding_policy, kernels=model.kernels
    )


def on_mesh(config: ModelConfig, weights, mesh: jax.sharding.Mesh, rules: dict[str, tuple] | None = None) -> CausalLM:
    """A model whose weights go straight to their shards on `mesh` (see `shard`). weights: arrays by name
    (device or host), or a function of {name: NamedSharding} returning them so placed (a sharded restore)."""
    specs = sharding.weight_specs(config, mesh, rules)
    shardings = {name: jax.sharding.NamedSharding(mesh, specs[name]) for name in weight_shapes(config)}
    placed = (
        weights(shardings)
        if callable(weights)
        else {name: jax.device_put(w, shardings[name]) for name, w in weights.items()}
    )
    return CausalLM(config, placed, mesh=mesh, embed_spec=specs["embed"])
