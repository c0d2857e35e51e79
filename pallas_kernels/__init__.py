"""Attention kernels behind `jcascade.attend` (installed as `jcascade.pallas_kernels`).

`Kernels` is the choice, made once: a frozen value carried as static data on the cache state
(`CacheState.kernels`) and the model (`CausalLM.kernels`). Its methods are the kernel package's entry points,
each with one contract and several implementations: `chunk_attention` (see `reference.chunk_attention`),
`prefix_attention` (`reference.prefix_attention`) and `insert` (`ring_insertion.insert_chunk`). Backends:
  "xla"         the plain-XLA references (any platform; the default on the CPU);
  "triton"      Pallas-Triton (GPU): chunk, decode and shared-prefix attention, and the single-token insertion;
  "mosaic_gpu"  Pallas Mosaic GPU (Hopper, sm_90; the default there): chunks (T > 1) in bf16 or f16 with head_dim
                64 or 128, and shared prefixes read by many queries with keys stored rotated; decode steps, the
                other shared-prefix calls and the single-token insertion run on the Triton kernels, which every
                GPU backend shares; chunks it cannot run go to Triton too (`fallback`, the default) or are refused;
  "mosaic_tpu"  Pallas Mosaic TPU (the default on TPU).
A Pallas backend on the CPU runs in interpret mode (tests).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import attention_state, mosaic_gpu, reference, ring_insertion, schedule, storage, tpu, triton
from .mosaic_gpu import MosaicGpuConfig
from .storage import Stored
from .tpu import TpuConfig
from .triton import WIDE as TRITON_WIDE
from .triton import TritonConfig
from .triton_insert import insert_one

BACKENDS = ("xla", "triton", "mosaic_gpu", "mosaic_tpu")
NATIVE = {"triton": "gpu", "mosaic_gpu": "gpu", "mosaic_tpu": "tpu"}  # the platform each Pallas backend compiles for


XLA_LOGITS_BYTES = 1 << 28  # the XLA path's budget for one array of a block's logits, float32


def xla_query_block(q_shape: tuple, slots: int) -> int:
    """Queries per block of the XLA path's chunk attention (`reference.chunk_attention_blocked`) for q [B, T, Hq, D]
    over `slots` cached keys plus the chunk's: the largest power of two (at least 16) whose logits [B, Hq, block,
    slots + T] fit XLA_LOGITS_BYTES; a chunk within it (a decode step, a tiny model's chunk) is one block."""
    B, T, Hq, _ = q_shape
    fit = XLA_LOGITS_BYTES // (4 * B * Hq * (slots + T))
    return T if fit >= T else max(16, 1 << max(fit, 1).bit_length() - 1)


def is_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which attention kernels a computation runs, and their tuning (hashable: static under jit).

    backend:     one of BACKENDS (see the module doc); a Pallas backend must suit the default platform (its
                 own, or the CPU, where it runs in interpret mode).
    fallback:    "mosaic_gpu" only: chunks its kernels cannot run (f32, other head_dims) go to Triton; False
                 refuses them (tests that must exercise Mosaic GPU).
    triton, mosaic_gpu, tpu: the block sizes of each backend (validated by their classes); triton_wide: the Triton
                 tiles for head_dim above `triton.WIDE_HEAD_DIM` (Gemma 4's global layers: 512; `triton.WIDE`).
    interpret:   (derived) whether the Pallas kernels run in interpret mode: a Pallas backend on the CPU.
    `Kernels.default()` is the platform's choice.
    """

    backend: str
    _: dataclasses.KW_ONLY
    fallback: bool = True
    triton: TritonConfig = TritonConfig()
    triton_wide: TritonConfig = TRITON_WIDE
    mosaic_gpu: MosaicGpuConfig = MosaicGpuConfig()
    tpu: TpuConfig = TpuConfig()
    interpret: bool = dataclasses.field(init=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Kernels.backend must be one of {BACKENDS}, got {self.backend!r}")
        platform = jax.default_backend()
        native = NATIVE.get(self.backend)
        if native is not None and platform not in (native, "cpu"):
            raise ValueError(
                f"Kernels.backend={self.backend!r} cannot run on platform {platform!r}; "
                f"Kernels.default() is {default_backend()!r} here"
            )
        if not isinstance(self.fallback, bool):
            raise ValueError(f"Kernels.fallback must be a bool, got {self.fallback!r}")
        for name, cls in (
            ("triton", TritonConfig),
            ("triton_wide", TritonConfig),
            ("mosaic_gpu", MosaicGpuConfig),
            ("tpu", TpuConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"Kernels.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "interpret", platform == "cpu" and native is not None)

    def __repr__(self) -> str:
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)[1:]
            if f.init and getattr(self, f.name) != f.default
        ]
        return f"Kernels({', '.join([repr(self.backend), *changed])})"

    def triton_tiles(self, head_dim: int) -> TritonConfig:
        """The Triton tiles for heads of `head_dim`: `triton`, or `triton_wide` past `triton.WIDE_HEAD_DIM`."""
        return self.triton if head_dim <= triton.WIDE_HEAD_DIM else self.triton_wide

    @property
    def on_gpu(self) -> bool:
        """Whether this is a GPU backend (Triton or Mosaic GPU, which share the Triton decode and insertion)."""
        return NATIVE.get(self.backend) == "gpu"

    @classmethod
    def default(cls) -> Kernels:
        """The default platform's kernels: Mosaic GPU (with Triton for the rest) on a Hopper GPU, Triton on other
        GPUs, Mosaic TPU on TPU, XLA on the CPU."""
        return cls(default_backend())

    def chunk_attention(
        self,
        q,
        k,
        v,
        k_cache: Stored,
        v_cache: Stored,
        cache_valid,
        cache_positions,
        lengths,
        query_weights=None,
        head_reduction="max",
        rope=None,
        *,
        layer=None,
        first_slot: int = 0,
    ):
        """`reference.chunk_attention` on this backend, over a cache as it is stored (k_cache, v_cache: `Stored`).
        layer: None, or an int32 scalar when k_cache and v_cache hold a model's stacked cache [L, B, Hkv, C, D]:
        the call attends to that layer. first_slot (a static int): the call attends to slots [first_slot,
        first_slot + S) of k_cache and v_cache, S = cache_valid.shape[-1] (cache_valid and cache_positions cover
        those slots alone). The Triton decode kernel reads both in place; the other paths take the slice. A
        quantized cache (8-bit codes with their scales): a decode step on a GPU backend (with RoPE the kernel fuses,
        or none) dequantizes them in the Triton decode kernel's registers, and the Mosaic TPU kernels read the value
        codes (the keys dequantized with their rotation); the other paths dequantize (to q's dtype) in a copy of the
        attended slots (fused with the keys' rotation), then attend as to a cache in the model's dtype.
        `quantized_decode_path` says which a decode step takes."""
        if k_cache.shape[-2] != first_slot + cache_valid.shape[-1]:
            raise ValueError(
                f"k_cache has {k_cache.shape[-2]} slots; first_slot={first_slot} plus the "
                f"{cache_valid.shape[-1]} slots of cache_valid must equal it"
            )
        path = self.quantized_decode_path(k_cache, rope)
        if self.on_gpu and q.shape[1] == 1 and path != "dequantized copy":
            return triton.chunk_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                cache_valid,
                cache_positions,
                lengths,
                query_weights,
                head_reduction,
                rope,
                layer,
                first_slot,
                config=self.triton_tiles(q.shape[-1]),
                interpret=self.interpret,
            )
        if k_cache.quantized:  # the attended layer's codes and scales from first_slot
            k_cache, v_cache = (c.of_layer(layer).slots_from(first_slot) for c in (k_cache, v_cache))
            layer, first_slot = None, 0
            if self.backend == "mosaic_tpu":  # its kernels take the codes
                return tpu.chunk_attention(
                    q,
                    k,
                    v,
                    k_cache,
                    v_cache,
                    cache_valid,
                    cache_positions,
                    lengths,
                    query_weights,
                    head_reduction,
                    rope,
                    config=self.tpu,
                    interpret=self.interpret,
                )
            k_cache, v_cache = (Stored(c.decode(q.dtype)) for c in (k_cache, v_cache))
        k_cache, v_cache = k_cache.data, v_cache.data
        if self.backend == "mosaic_gpu" and q.shape[1] > 1:
            if mosaic_gpu.supports(q, k_cache):
                k_cache, v_cache = (
                    triton.layer_of(k_cache, layer, first_slot),
                    triton.layer_of(v_cache, layer, first_slot),
                )
                return mosaic_gpu.chunk_attention(
                    q,
                    k,
                    v,
                    k_cache,
                    v_cache,
                    cache_valid,
                    cache_positions,
                    lengths,
                    query_weights,
                    head_reduction,
                    rope,
                    config=self.mosaic_gpu,
                    interpret=self._mosaic_interpret(),
                )
            if not self.fallback:
                raise ValueError(
                    f"Kernels(backend='mosaic_gpu', fallback=False) runs chunks with q and the cache in "
                    f"bfloat16 or float16 and head_dim in {mosaic_gpu.HEAD_DIMS}, got {q.dtype}, "
                    f"{k_cache.dtype} and {q.shape[-1]}"
                )
        if self.on_gpu:
            return triton.chunk_attention(
                q,
                k,
                v,
                Stored(k_cache),
                Stored(v_cache),
                cache_valid,
                cache_positions,
                lengths,
                query_weights,
                head_reduction,
                rope,
                layer,
                first_slot,
                config=self.triton_tiles(q.shape[-1]),
                interpret=self.interpret,
            )
        k_cache, v_cache = triton.layer_of(k_cache, layer, first_slot), triton.layer_of(v_cache, layer, first_slot)
        args = (q, k, v, k_cache, v_cache, cache_valid, cache_positions, lengths, query_weights, head_reduction, rope)
        if self.backend == "xla":
            return reference.chunk_attention_blocked(*args, block=xla_query_block(q.shape, k_cache.shape[-2]))
        return tpu.chunk_attention(
            *args[:3], Stored(k_cache), Stored(v_cache), *args[5:], config=self.tpu, interpret=self.interpret
        )

    def quantized_decode_path(self, cache: Stored, rope=None) -> str:
        """How a decode step (`chunk_attention` with T == 1) reads a cache (`Stored`: a layer [B, Hkv, C, D], or a
        stack [L, B, Hkv, C, D]) under `rope`: "in place" (the Triton decode kernel reads it, dequantizing codes in
        registers), "in place as pairs" (the same kernel reading codes as int16 pairs: a stack of 2**31 to 2**32
        codes it cannot address by the byte, `triton.addresses_fit`; head_dim a multiple of 4 and >= 64) or
        "dequantized copy" (every other backend, RoPE or head_dim; a cache in the model's dtype on a GPU backend
        is read in place by the decode kernel, with any RoPE)."""
        if not self.on_gpu:
            return "dequantized copy"
        if not cache.quantized:
            return "in place"
        if rope is not None and not triton.fuses_rope(rope):
            return "dequantized copy"
        if triton.addresses_fit(cache.data):
            return "in place"
        return "in place as pairs" if triton.reads_pairs(cache.shape[-1]) else "dequantized copy"

    def prefix_attention(self, q, k_cache: Stored, v_cache: Stored, cache_valid, cache_positions, rope=None):
        """`reference.prefix_attention` (many requests' queries against a shared prefix) on this backend, over the
        prefix as it is stored (`Stored`). On GPU: with the keys already rotated (rope None, as
        `jcascade.share_prefix(..., rope=)` stores them) and calls that `mosaic_gpu.supports_prefix` (many query
        rows per KV head), the Mosaic GPU forward ("mosaic_gpu"); otherwise the Triton multi-query kernel. On TPU it
        runs the XLA reference. The Mosaic GPU path needs finite keys and values in empty slots (`SharedPrefix`
        stores zeros there). A quantized prefix: the Triton kernel dequantizes its codes in registers (on GPU, with
        RoPE it fuses or none, codes it can address: `triton.addresses_fit`); every other path dequantizes a copy
        (to q's dtype) first."""
        if k_cache.quantized and self.quantized_decode_path(k_cache, rope) != "in place":
            k_cache, v_cache = (Stored(c.decode(q.dtype)) for c in (k_cache, v_cache))
        if not k_cache.quantized:  # codes the Triton kernel reads in place go to it (the decode kernel, many queries)
            if not self.on_gpu:
                return reference.prefix_attention(q, k_cache.data, v_cache.data, cache_valid, cache_positions, rope)
            if (
                self.backend == "mosaic_gpu"
                and rope is None
                and mosaic_gpu.supports_prefix(q, k_cache.data, self.mosaic_gpu)
            ):
                return mosaic_gpu.prefix_attention(
                    q,
                    k_cache.data,
                    v_cache.data,
                    cache_valid,
                    config=self.mosaic_gpu,
                    interpret=self._mosaic_interpret(),
                )
        return triton.prefix_attention(
            q,
            k_cache,
            v_cache,
            cache_valid,
            cache_positions,
            rope,
            config=self.triton_tiles(q.shape[-1]),
            interpret=self.interpret,
        )

    def insert(
        self,
        layout,
        k_cache: Stored,
        v_cache: Stored,
        layer,
        score,
        pos,
        seen,
        k: Stored,
        v: Stored,
        chunk_score,
        placed,
        n,
        place_evicted=None,
    ):
        """`ring_insertion.insert_chunk` (same arguments and result) on this backend: a single-token chunk on a
        GPU backend runs the in-place Triton kernel (layouts without heavy slots; a stack it cannot address by the
        byte, `triton.addresses_fit`, as int16 pairs where head_dim is even); everything else runs the vectorised XLA
        formulation."""
        if (
            k.shape[1] == 1
            and self.on_gpu
            and not layout.heavy
            and all(triton.addresses_fit(c.data) or c.shape[-1] % 2 == 0 for c in (k_cache, v_cache))
        ):
            score, pos, k_cache, v_cache = insert_one(
                layout,
                score,
                pos,
                k_cache,
                v_cache,
                chunk_score,
                k,
                v,
                placed,
                n,
                seen,
                layer=layer,
                interpret=self.interpret,
            )
            return k_cache, v_cache, score, pos
        return ring_insertion.insert_chunk(
            layout, k_cache, v_cache, layer, score, pos, seen, k, v, chunk_score, placed, n, place_evicted
        )

    def _mosaic_interpret(self):
        return plgpu.InterpretGPUParams() if self.interpret else False


def default_backend() -> str:
    """The backend of `Kernels.default()` on the default platform."""
    platform = jax.default_backend()
    if platform == "gpu":
        return "mosaic_gpu" if is_hopper() else "triton"
    return "mosaic_tpu" if platform == "tpu" else "xla"


__all__ = [
    "BACKENDS",
    "Kernels",
    "MosaicGpuConfig",
    "Stored",
    "TpuConfig",
    "TritonConfig",
    "attention_state",
    "default_backend",
    "is_hopper",
    "mosaic_gpu",
    "reference",
    "ring_insertion",
    "schedule",
    "storage",
    "tpu",
    "triton",
]
