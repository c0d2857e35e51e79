"""The XLA options jcascade compiles with, and the `jit` that applies them.

On GPU, XLA's Triton GEMM emitter reads the weights of a decode step's matrix-vector products at about
1.2 TB/s on an H200, cuBLAS at about 3.3 TB/s (git history: benchmarks/RESULTS.md, "Whole model" b): decode at batch
1-32 runs 1.2-1.6x faster with Triton GEMMs off, and prefill is not slower. XLA's GPU pass
"dot-strength-reduction" rewrites a product of one row and a weight under 10M elements (and any product of
two vectors) into multiply and reduce fusions, which read the weight at a fraction of cuBLAS's bandwidth: off, a decode
step's one-row products stay cuBLAS products (in the 8B shape k and v always, q and o once tensor
parallelism shards them under 10M: its batch-1 step at TP = 2 on two H100s takes 6.3 ms against 8.0, at
TP = 1 2 % less, at TP = 4 on four H200s 4.6-5.0 ms against 5.3 with the trace cache below; Gemma 3 270M,
Qwen3.5 and Gemma 4 on one H200 from 5 % slower to 3 % faster: docs/results/multi-gpu.md, "The 8B decode step";
git history: benchmarks/RESULTS.md, "The one-row products off XLA's strength reduction"). The options are XLA
debug options, ignored by the other backends. Only the outermost `jax.jit` of a program may carry them: a user
who jits a pipeline around `jc.generate` passes `compiler_options=jc.COMPILER_OPTIONS` to that jit.

Importing jcascade also adds `TRACE_CACHE_FLAG` to the XLA_FLAGS environment variable (a size the user set
there is kept). XLA runs a program's kernels as command buffers (CUDA graphs) and records each cuBLAS call in
one by tracing it, keeping at most 16 traces, one per set of buffer addresses. In the layer loop a product's
weights lie elsewhere in every layer, so with more than 16 layers the cuBLAS calls are traced anew on the host
at every step, as raising the limit shows: where the kernels are short (an 8B batch-1 step sharded over four
H200s), the step waits for the host, 7.0-8.7 ms against 4.6-5.0 ms with 64 or 128 traces kept
(docs/results/multi-gpu.md, "The 8B decode step"). It is a runtime option: as a compiler option it
has no effect, and XLA reads XLA_FLAGS once, the first time a backend starts, so import jcascade before the
first JAX computation and do not replace XLA_FLAGS after. The flag is jaxlib 0.11.2's (constraints.txt); an
XLA that does not know a flag in XLA_FLAGS stops the process.
"""

from __future__ import annotations

import functools
import os

import jax

TRACE_CACHE_FLAG = "--xla_cmd_buffer_trace_cache_size=128"


def with_trace_cache_flag(xla_flags: str) -> str:
    """XLA_FLAGS with `TRACE_CACHE_FLAG` added, unless they already set the trace cache's size (theirs is kept)."""
    if "--xla_cmd_buffer_trace_cache_size=" in xla_flags:
        return xla_flags
    return f"{xla_flags} {TRACE_CACHE_FLAG}".strip()


os.environ["XLA_FLAGS"] = with_trace_cache_flag(os.environ.get("XLA_FLAGS", ""))

COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "dot-strength-reduction"}


def jit(fun=None, **jit_kwargs):
    """`jax.jit` (same arguments) that compiles with `COMPILER_OPTIONS` when called with concrete arguments
    and inlines as a plain jit when an argument is traced (inside a user's jit, vmap or grad). The
    wrapper's `top_level` is the former jitted function (e.g. to count its compilations)."""
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    top_level = jax.jit(fun, compiler_options=COMPILER_OPTIONS, **jit_kwargs)
    nested = jax.jit(fun, **jit_kwargs)

    @functools.wraps(fun)
    def call(*args, **kwargs):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        return (nested if traced else top_level)(*args, **kwargs)

    call.top_level = top_level
    return call
