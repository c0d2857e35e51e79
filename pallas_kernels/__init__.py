"""Attention kernels behind `jcascade.attend` (installed as `jcascade.pallas_kernels`).

One function, `chunk_attention`, with one contract (see `reference.chunk_attention`) and several
implementations, chosen here:
  "xla"         the plain-XLA reference (any platform; the default on the CPU),
  "pallas"      the platform's Pallas kernels (the default on GPU and TPU): on a Hopper GPU (sm_90) Mosaic GPU
                for chunks that `mosaic_gpu.supports` and Pallas-Triton for the rest, on other GPUs
                Pallas-Triton, on TPU Pallas-Mosaic;
  "triton", "mosaic_gpu", "mosaic_tpu"   one Pallas backend by name; on the CPU it runs in interpret mode
                (tests). "mosaic_gpu" runs chunks (T > 1) and shared prefixes read by many queries with keys
                stored rotated, in bf16 or f16; decode steps, the other shared-prefix calls and the single-token
                insertion stay on the Triton kernels, which every GPU backend shares.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import gpu, mosaic_gpu, reference, schedule, states, tpu

IMPLEMENTATIONS = ("xla", "pallas", "triton", "mosaic_gpu", "mosaic_tpu")
GPU_BACKENDS = ("triton", "mosaic_gpu")


def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def resolve(implementation: str | None) -> tuple[str, bool]:
    """(backend, interpret) for an implementation name on the current default platform: backend one of "xla",
    "triton", "mosaic_gpu" (both GPU backends; see the module doc) or "mosaic_tpu"."""
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
        implementation = ("mosaic_gpu" if is_hopper() else "triton") if platform == "gpu" else "mosaic_tpu"
    native = {"triton": "gpu", "mosaic_gpu": "gpu", "mosaic_tpu": "tpu"}.get(implementation)
    if native is not None and platform not in (native, "cpu"):
        raise ValueError(f"implementation={implementation!r} cannot run on platform {platform!r}")
    return implementation, platform == "cpu" and native is not None


def _config(config, cls):
    """`config` when it is a `cls` (a backend's block sizes), else that backend's defaults."""
    return config if isinstance(config, cls) else cls()


def chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights=None,
                    head_reduction="max", rope=None, *, layer=None, first_slot: int = 0,
                    implementation: str | None = None, config=None):
    """Dispatches to an implementation; `config`: a `gpu.GpuConfig`, `mosaic_gpu.MosaicGpuConfig` or
    `tpu.TpuConfig` (block sizes), which the backend of that type takes (the others use their defaults).
    layer: None, or an int32 scalar when k_cache and v_cache are a model's stacked cache [L, B, Hkv, C, D]:
    the call attends to that layer. first_slot (a static int): the call attends to slots
    [first_slot, first_slot + S) of k_cache and v_cache, S = cache_valid.shape[-1] (cache_valid and
    cache_positions cover those slots alone). The Triton decode kernel reads both in place; the other paths
    take the slice."""
    backend, interpret = resolve(implementation)
    if k_cache.shape[-2] != first_slot + cache_valid.shape[-1]:
        raise ValueError(f"k_cache has {k_cache.shape[-2]} slots; first_slot={first_slot} plus the "
                         f"{cache_valid.shape[-1]} slots of cache_valid must equal it")
    if backend == "mosaic_gpu" and q.shape[1] > 1:
        if mosaic_gpu.supports(q, k_cache):
            k_cache, v_cache = gpu.layer_of(k_cache, layer, first_slot), gpu.layer_of(v_cache, layer, first_slot)
            return mosaic_gpu.chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths,
                                              query_weights, head_reduction, rope,
                                              config=_config(config, mosaic_gpu.MosaicGpuConfig),
                                              interpret=plgpu.InterpretGPUParams() if interpret else False)
        if implementation == "mosaic_gpu":
            raise ValueError(f"implementation='mosaic_gpu' runs chunks with q and the cache in bfloat16 or float16 "
                             f"and head_dim in {mosaic_gpu.HEAD_DIMS}, got {q.dtype}, {k_cache.dtype} and {q.shape[-1]}")
    if backend in GPU_BACKENDS:
        return gpu.chunk_attention(q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights,
                                   head_reduction, rope, layer, first_slot, config=_config(config, gpu.GpuConfig),
                                   interpret=interpret)
    k_cache, v_cache = gpu.layer_of(k_cache, layer, first_slot), gpu.layer_of(v_cache, layer, first_slot)
    args = (q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights, head_reduction, rope)
    if backend == "xla":
        return reference.chunk_attention(*args)
    return tpu.chunk_attention(*args, config=_config(config, tpu.TpuConfig), interpret=interpret)


def prefix_attention(q, k_cache, v_cache, cache_valid, cache_positions, rope=None, *,
                     implementation: str | None = None, config=None):
    """Dispatches `reference.prefix_attention` (many requests' queries against a shared prefix). On GPU: with
    the keys already rotated (rope None, as `jcascade.share_prefix(..., rope=)` stores them) and calls that
    `mosaic_gpu.supports_prefix` (many query rows per KV head), the Mosaic GPU forward on a Hopper GPU
    ("pallas" or "mosaic_gpu"); otherwise the Triton multi-query kernel. On TPU it runs the XLA reference.
    The Mosaic GPU path needs finite keys and values in empty slots (`SharedPrefix` stores zeros there)."""
    backend, interpret = resolve(implementation)
    args = (q, k_cache, v_cache, cache_valid, cache_positions, rope)
    if backend not in GPU_BACKENDS:
        return reference.prefix_attention(*args)
    mosaic_config = _config(config, mosaic_gpu.MosaicGpuConfig)
    if backend == "mosaic_gpu" and rope is None and mosaic_gpu.supports_prefix(q, k_cache, mosaic_config):
        return mosaic_gpu.prefix_attention(q, k_cache, v_cache, cache_valid, config=mosaic_config,
                                           interpret=plgpu.InterpretGPUParams() if interpret else False)
    return gpu.prefix_attention(*args, config=_config(config, gpu.GpuConfig), interpret=interpret)


__all__ = ["GPU_BACKENDS", "IMPLEMENTATIONS", "chunk_attention", "is_hopper", "mosaic_gpu", "prefix_attention", "gpu",
           "reference", "resolve", "schedule", "states", "tpu"]
