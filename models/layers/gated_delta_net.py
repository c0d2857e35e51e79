"""A linear layer (Qwen3.5): the Gated DeltaNet (`delta_net.gated_delta_net`) over its fixed-size recurrent state."""

from __future__ import annotations

import jax
from jcascade.models import delta_net
from jcascade.models.config import LINEAR
from jcascade.models.layers import Context

WEIGHTS = ("lin_qkv", "lin_z", "lin_b", "lin_a", "lin_conv", "lin_dt_bias", "lin_a_log", "lin_norm", "lin_out")


def mixer(ctx: Context):
    """The mixer of a linear layer."""
    sizes = ctx.cfg.linear

    def call(fetch, h, state, pending, index, layer_prefixes):
        own = jax.tree.map(lambda a: a[index], state.linear)
        out, own = delta_net.gated_delta_net(
            {name: fetch(name) for name in WEIGHTS},
            h,
            own,
            ctx.lengths,
            num_key_heads=sizes.key_heads,
            num_value_heads=sizes.value_heads,
            key_dim=sizes.key_dim,
            value_dim=sizes.value_dim,
            eps=ctx.cfg.rms_norm_eps,
        )
        written = jax.tree.map(lambda a, b: a.at[index].set(b), state.linear, own)
        return out, state.replaced(LINEAR, written), pending

    return call
