"""The decoder of every family in `config.ARCHITECTURES` as a Flax NNX module, attention delegated to jcascade's
cache policies.

Every family runs as one block: an RMSNorm before (and, with `Norms.post`, after) the token mixer and the MLP,
residual adds, and the family's differences as config features (`ModelConfig`: norms, rotary positions, attention,
activation, per-layer inputs, logit soft-cap), never its name. The token mixer is the layer's kind
(`models.layers`: attention over the policy's cache, over a window cache, over another layer's cache, without
rotary positions, or the Gated DeltaNet). The L layers' weights are stacked on a leading axis and run under
`lax.scan`, each kind's mixer under `lax.switch`, so a model compiles as one layer of each kind whatever its depth.
Each attention layer calls `jcascade.attend` then `jcascade.update` on its view of the cache
(`models.layers.view`), so every policy works unchanged. The state (`ModelState`, by layer type) is the scan's
carry; the cache is held once (tests/models/test_decoder.py) and a decode step moves no K/V beyond what it reads
and inserts. A policy's data-dependent branch that all layers take alike (`Policy.step_branch`) is decided once,
around the loop.

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
from jcascade.models.layers import Context, build, kind_of, shared_kv, view
from jcascade.models.state import ModelState
from jcascade.models.weights import declarations, weight_shapes
from jcascade.pallas_kernels import Kernels

from jcascade import cache_api, cache_state
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

    def init_cache(self, policy, batch: int, max_tokens: int | None = None) -> ModelState:
        """An empty `ModelState` in the model's dtype, with the model's kernels: `policy`'s cache of the global layers,
        the window cache of the sliding ones (`window_policy`), the recurrent states of the linear ones, each stacked
        over its layers that keep one. On a sharded model's mesh, rows over "data" and KV heads over "model". What
        the caches store is decided here, once for all of them: the policy's format (`kv_dtype`), and keys rotated
        at their original positions by the RoPE of their layers (`CacheState.rope`; a layer without rotary
        positions stores its keys as they are)."""
        cfg = self.config

        def make(layer_type):
            layers = len(cfg.layers_with_state(layer_type))
            if not layers:
                return None
            if layer_type == LINEAR:
                sizes = cfg.linear
                state = delta_net.init_linear_state(
                    batch,
                    num_value_heads=sizes.value_heads,
                    key_dim=sizes.key_dim,
                    value_dim=sizes.value_dim,
                    conv_channels=2 * sizes.key_heads * sizes.key_dim + sizes.value_heads * sizes.value_dim,
                    kernel=sizes.conv_kernel,
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
                    rope=cfg.local_rope if layer_type == SLIDING else cfg.rope,
                )
                specs = None if self.mesh is None else sharding.cache_specs(state, self.mesh)
            return state if specs is None else sharding.place(state, specs, self.mesh)

        return ModelState(cache=make(GLOBAL), window=make(SLIDING), linear=make(LINEAR))

    def layer_cache(self, state: ModelState, layer: int) -> tuple[cache_state.CacheState, int]:
        """The stacked cache of `state` that model layer `layer` (an int) attends to, and that cache's index in it (a
        layer reading an earlier layer's cache gets that one). A ValueError for a linear layer (it keeps no KV
        cache)."""
        cfg = self.config
        layer_type = cfg.types[layer]
        if layer_type == LINEAR:
            raise ValueError(f"layer {layer} is a linear-attention layer: it keeps a recurrent state, no KV cache")
        return state.of(layer_type), cfg.layers_with_state(layer_type).index(cfg.reads_from(layer))

    def compress(self, policy, state: ModelState, room: int) -> ModelState:
        """`jcascade.compress` of the global layers' cache after a prompt (a policy with an observation window); the
        other layers' states are kept as they are."""
        return dataclasses.replace(state, cache=cache_api.compress(policy, state.cache, room))

    def _norm(self, x: jax.Array, weight: jax.Array | None) -> jax.Array:
        cfg = self.config
        return rms_norm(x, weight, cfg.rms_norm_eps, plus_one=cfg.norms.plus_one, scale_f32=cfg.norms.scale_f32)

    def __call__(
        self, policy, state: ModelState, tokens: jax.Array, lengths: jax.Array, prefixes: tuple = ()
    ) -> tuple[jax.Array, ModelState]:
        """One chunk through all layers. tokens int32 [B, T]; lengths int32 [B] valid prefix per row;
        prefixes: `jcascade.SharedPrefix` levels (layers stacked) that the rows' histories begin with.
        Returns the final-norm hidden states [B, T, hidden] and the updated state (`init_cache`'s). The attention
        runs on the cache's kernels (`CacheState.kernels`)."""
        cfg = self.config
        if not isinstance(state, ModelState):
            raise TypeError(f"state must be a ModelState (CausalLM.init_cache), got {type(state).__name__}")
        if prefixes and (set(cfg.types) != {GLOBAL} or cfg.kv_shared_layers or cfg.nope_layers):
            raise ValueError(
                "shared prefixes (num_samples, context=) are not supported for models with sliding or "
                "linear layers, shared caches or layers without rotary positions (Gemma 3 and 4, Qwen3.5, SmolLM3)"
            )
        x = sharding.embed(self.embed[...], tokens, self.mesh, self.embed_spec)
        if cfg.embed_scaled:
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        per_layer = self._per_layer_inputs(tokens, x) if cfg.per_layer_input_size else None
        layers = functools.partial(self._layers, lengths=lengths, prefixes=tuple(prefixes), per_layer=per_layer)
        branch = policy.step_branch(view.layer(state.cache, jnp.int32(0), cfg.rope), tokens.shape[1], lengths)
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
        self, policy, x: jax.Array, state: ModelState, *, lengths, prefixes: tuple, per_layer
    ) -> tuple[jax.Array, ModelState]:
        """x [B, T, hidden] (embedded) through every layer under `lax.scan`; returns it and the state. Each layer runs
        the mixer of its kind (`layers.kind_of`) under `lax.switch`, so each kind compiles once; the state rides in
        the scan's carry. per_layer: Gemma 4's per-layer inputs [L, B, T, P] (or None)."""
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
        ctx = Context(
            cfg=cfg,
            policy=policy,
            window_policy=self.window_policy(policy) if SLIDING in cfg.types else None,
            lengths=lengths,
            batch=x.shape[0],
            tokens=x.shape[1],
            norm=self._norm,
            fused_qkv="wqkv" in decl,
            mesh=self.mesh,
            specs=None if self.mesh is None else sharding.layer_specs(state.cache, self.mesh, prefixes),
        )
        kinds = [kind_of(cfg, i) for i in range(cfg.num_layers)]
        mixers = {kind: build(ctx, *kind) for kind in dict.fromkeys(kinds)}
        branch = jnp.asarray([list(mixers).index(kind) for kind in kinds], jnp.int32)
        slot = jnp.asarray(
            [cfg.layers_with_state(t).index(cfg.reads_from(i)) for i, (_, t, _) in enumerate(kinds)],
            jnp.int32,
        )  # the state a layer reads, in its type's stack
        norm, norms = self._norm, cfg.norms
        act = functools.partial(jax.nn.gelu, approximate=True) if cfg.activation == "gelu_tanh" else jax.nn.silu

        def layer(carry, inputs):
            x, state, pending = carry
            w, rank, branch_index, index, layer_prefixes, extra = inputs
            fetch = lambda name: w[name] if name in w else stacks[name][rank[decl[name].layers]]
            h = norm(x, w["attn_norm"]) if norms.pre else x
            o, state, pending = jax.lax.switch(
                branch_index,
                [functools.partial(m, fetch) for m in mixers.values()],
                h,
                state,
                pending,
                index,
                layer_prefixes,
            )
            x = x + (norm(o, w["post_attn_norm"]) if norms.post else o)
            h = norm(x, w["mlp_norm"]) if norms.pre else x
            gate_up = jnp.einsum("btd,dci->btci", h, w["w_gate_up"])  # [in, 2, intermediate] (models.weights.FUSED)
            m = (act(gate_up[:, :, 0]) * gate_up[:, :, 1]) @ w["w_down"]
            x = x + (norm(m, w["post_mlp_norm"]) if norms.post else m)
            if extra is not None:  # Gemma 4's per-layer input
                g = jax.nn.gelu(x @ w["ple_gate"], approximate=True) * extra
                x = x + norm(g @ w["ple_proj"], w["ple_norm"])
            if cfg.layer_scalar:
                x = x * w["layer_scalar"].astype(x.dtype)
            return (x, state, pending), None

        pending = shared_kv.initial_pending(ctx, state, x.dtype)
        (x, state, pending), _ = jax.lax.scan(
            layer, (x, state, pending), (scanned, ranks, branch, slot, prefixes, per_layer)
        )
        return x, shared_kv.finish(ctx, state, pending)  # the caches that later layers read, updated last

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 [..., vocab] from final hidden states [..., hidden] (Gemma 4: soft-capped, cap * tanh(x / cap))."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        logits = _float32_product(hidden, head)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _float32_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 x [..., K] @ w [K, N] of bf16 (or other) operands. A single row is doubled: XLA on GPUs runs a
    one-row product with a float32 result by first converting the whole weight to float32 (about 1 ms of an 8B
    batch-1 decode step on an H200, 1.3 ms on an H100, for the head's 1 GB); two rows keep one cuBLAS product of
    the weight as it is."""
    rows = x.reshape(-1, x.shape[-1])
    padded = jnp.concatenate([rows, rows]) if rows.shape[0] == 1 else rows
    out = jnp.dot(padded, w, preferred_element_type=jnp.float32)[: rows.shape[0]]
    return out.reshape(*x.shape[:-1], w.shape[-1])


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
