"""Attention kernels behind `jcascade.attend` (installed as `jcascade.pallas_kernels`).

One function, `chunk_attention`, with one contract (see `reference.chunk_attention`) and several
implementations, chosen here:
  "xla"         the plain-XLA reference (any platform; the default on the CPU),
  "pallas"      the platform's Pallas kernels: Pallas-Triton on GPU, Pallas-Mosaic on TPU (the default there),
  "triton", "mosaic_tpu"   one Pallas backend by name; on the CPU it runs in interpret mode (tests).
"""

from __future__ import annotations

import jax

from . import gpu, reference, schedule, states, tpu

IMPLEMENTATIONS = ("xla", "pallas", "triton", "mosaic_tpu")


def resolve(implementation: str | None) -> tuple[str, bool]:
    """(backend, interpret) for an implementation name on the current default platform."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    platform = jax.default_backend()
    if implementation is None:
        implementation = "pallas" if platform in ("gpu", "tpu") else "xla"
    if implementation == "pallas":
        if platform not in ("gpu", "tpu"):
            raise ValueError(
                f"implementation='pallas' needs a GPU or TPU (default platform is {platform!r}); use 'xla', "
                "or name a backend ('triton', 'mosaic_tpu') to run it in interpret mode"
            )
        implementation = "triton" if platform == "gpu" else "mosaic_tpu"
    native = {"triton": "gpu", "mosaic_tpu": "tpu"}.get(implementation)
    if native is not None and platform not in (native, "cpu"):
        raise ValueError(f"implementation={implementation!r} cannot run on platform {platform!r}")
    return implementation, platform == "cpu" and native is not None


def chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights=None,
                    head_reduction="max", rope=None, *, layer=None, first_slot: int = 0,
                    implementation: str | None = None, config=None):
    """Dispatches to an implementation; `config` is a `gpu.GpuConfig` or `tpu.TpuConfig` (block sizes).
    layer: None, or an int32 scalar when k_cache and v_cache are a model's stacked cache [L, B, Hkv, C, D]:
    the call attends to that layer. first_slot (a static int): the call attends to slots
    [first_slot, first_slot + S) of k_cache and v_cache, S = cache_valid.shape[-1] (cache_valid and
    cache_positions cover those slots alone). The Triton decode kernel reads both in place; the other paths
    take the slice."""
    backend, interpret = resolve(implementation)
    if k_cache.shape[-2] != first_slot + cache_valid.shape[-1]:
        raise ValueError(f"k_cache has {k_cache.shape[-2]} slots; first_slot={first_slot} plus the "
                         f"{cache_valid.shape[-1]} slots of cache_valid must equal it")
    if backend == "triton":
        return gpu.chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights,
                                   head_reduction, rope, layer, first_slot, config=config or gpu.GpuConfig(),
                                   interpret=interpret)
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    k_cache, v_cache = k_cache[..., first_slot:, :], v_cache[..., first_slot:, :]
    args = (q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights, head_reduction, rope)
    if backend == "xla":
        return reference.chunk_attention(*args)
    return tpu.chunk_attention(*args, config=config or tpu.TpuConfig(), interpret=interpret)


def prefix_attention(q, k_cache, v_cache, cache_valid, cache_positions, rope=None, *,
                     implementation: str | None = None, config=None):
    """Dispatches `reference.prefix_attention` (many requests' queries against a shared prefix). The
    Pallas version is the GPU one (Triton); on TPU it runs the XLA reference."""
    backend, interpret = resolve(implementation)
    args = (q, k_cache, v_cache, cache_valid, cache_positions, rope)
    if backend != "triton":
        return reference.prefix_attention(*args)
    return gpu.prefix_attention(*args, config=config if config is not None else gpu.GpuConfig(), interpret=interpret)


__all__ = ["IMPLEMENTATIONS", "chunk_attention", "prefix_attention", "gpu", "reference", "resolve", "schedule", "states",
           "tpu"]
