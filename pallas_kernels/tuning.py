"""Validation of the kernels' tuning configs (`triton.TritonConfig`, `mosaic_gpu.MosaicGpuConfig`, `tpu.TpuConfig`)."""

from __future__ import annotations

from collections.abc import Callable


def check_fields(config: object, names: tuple[str, ...], rule: str, ok: Callable[[int], bool]) -> None:
    """Raises ValueError naming `Config.field` unless each named field is an int (not a bool) for which ok holds."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            raise ValueError(f"{type(config).__name__}.{name} must be {rule}, got {value!r}")


def power_of_two(minimum: int) -> Callable[[int], bool]:
    """ok(value): a power of two >= minimum."""
    return lambda value: value >= minimum and value & (value - 1) == 0
