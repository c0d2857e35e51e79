"""The main job (`jcascade compare`): passkey retrieval under Sink and Cascade caches of the same size, with
settings per machine, chosen by measurement (docs/results/main-job.md)."""

from __future__ import annotations

import jcascade as jc

PAIR = dict(cache_size=512, sinks=64, cascades=4, stride=256)  # the default pair of passkey, perplexity, attention-map
SETTINGS = {
    "cpu": dict(
        cache_size=384, sinks=64, cascades=2, stride=192, min_length=768, max_length=768, samples=24, filler="repeat"
    ),
    "gpu": dict(
        cache_size=768, sinks=64, cascades=2, stride=384, min_length=1536, max_length=1536, samples=100, filler="repeat"
    ),
    "gpu-qwen": dict(
        cache_size=4096, sinks=64, cascades=4, stride=2048, min_length=8192, max_length=8192, samples=50, filler="words"
    ),
}


def policies(cache_size: int, sinks: int, cascades: int, stride: int) -> list:
    """The main job's pair: StreamingLLM's Sink and the Cascade cache, both sinks + cache_size tokens."""
    return [
        jc.Sink(window=cache_size, sinks=sinks, stride=stride),
        jc.Cascade(cache_size=cache_size, sinks=sinks, num_cascades=cascades, stride=stride),
    ]


def defaults() -> dict:
    """The main job's settings for this machine: the CPU setting (SmolLM2, sized for about 5 minutes on 2
    cores); on a GPU more trials, and Qwen2.5-Coder-0.5B when it is already in the model cache."""
    import jax

    if jax.default_backend() == "cpu":
        return SETTINGS["cpu"] | {"model": None}
    qwen = jc.models.packaged.cache_dir() / jc.models.QWEN25_CODER_05B_INSTRUCT.name
    if jc.models.packaged.converted(qwen):
        return SETTINGS["gpu-qwen"] | {"model": str(qwen)}
    return SETTINGS["gpu"] | {"model": None}


def describe() -> str:
    """The settings per machine as options, e.g. "cpu: --cache-size 384, ...; gpu: ..."."""
    return "; ".join(
        f"{machine}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
        for machine, settings in SETTINGS.items()
    )
