"""The slot layout of ring caches and the closed-form ring schedule of the cascading cache (docs/semantics.md §3).

Where a token goes never depends on scores, only on its row's clock t (non-sink tokens seen before it):
Fill phase (t < C = N * W): every ring accepts, so the cache fills like one sliding window and holds
every token (the "eager fill" of the paper's code; it makes the cache hold every token while a row has
seen at most S0 + C). Ring i receives on clocks iW <= t < C.
Steady phase (t >= C, every ring full): ring i receives on multiples of 2**(i-1) (ring 0 on every
clock) and accepts on multiples of 2**i; its other arrivals compare against its newest token.
Ring write k goes to slot k mod W, so fill counts and ring heads follow from the counts below.
The functions take int32 arrays (or scalars inside a kernel); the constants are Python ints.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Slot layout of a ring cache: [sinks | ring 0 | ring 1 | ... | ring N-1 | heavy].

    Ring 0 receives every non-sink token; ring i+1 receives the tokens ring i evicts. Ring i, once full,
    accepts (appends and evicts its oldest) on clocks t with t mod 2**i == 0; otherwise the incoming
    token replaces the ring's newest token only if its score is strictly larger (docs/semantics.md §3). `heavy`
    slots after the rings receive tokens the last ring evicts, as the policy chooses (H2O). A layout of
    sinks only is an append cache: tokens fill the slots in order and are never evicted.
    """

    sinks: int
    ring_size: int
    num_rings: int
    heavy: int = 0

    @property
    def capacity(self) -> int:
        return self.sinks + self.ring_size * self.num_rings + self.heavy

    @property
    def appends(self) -> bool:
        return self.num_rings == 0 and self.heavy == 0


def multiples_in(lo: int, t: jax.Array, period: int) -> jax.Array:
    """Number of multiples of `period` in [lo, t) (0 when t <= lo); lo, period static, t int32 >= 0."""
    ceil_t = t // period + (t % period != 0)
    ceil_lo = -(-lo // period)
    return jnp.maximum(ceil_t - ceil_lo, 0)


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    index: int  # i
    ring_size: int  # W
    total: int  # C = N * W: clocks below this belong to the fill phase

    @property
    def accept_period(self) -> int:
        return 2**self.index

    @property
    def arrival_period(self) -> int:
        return 1 if self.index == 0 else 2 ** (self.index - 1)

    def fill_phase_arrivals(self, t: jax.Array) -> jax.Array:
        """Arrivals (all of them writes) before clock t during the fill phase."""
        return jnp.maximum(jnp.minimum(t, self.total) - self.index * self.ring_size, 0)

    def arrivals(self, t: jax.Array) -> jax.Array:
        """Tokens that reached ring i before clock t."""
        return self.fill_phase_arrivals(t) + multiples_in(self.total, t, self.arrival_period)

    def writes(self, t: jax.Array) -> jax.Array:
        """Tokens written into ring i's slots before clock t."""
        return self.fill_phase_arrivals(t) + multiples_in(self.total, t, self.accept_period)

    def fill(self, t: jax.Array) -> jax.Array:
        return jnp.minimum(self.fill_phase_arrivals(t), self.ring_size)

    def accepting(self, t: jax.Array) -> jax.Array:
        """Whether a full ring i appends (evicting its oldest) rather than compares at clock t."""
        return (t < self.total) | (t % self.accept_period == 0)


def ring_schedules(layout: RingLayout) -> list[RingSchedule]:
    total = layout.ring_size * layout.num_rings
    return [RingSchedule(i, layout.ring_size, total) for i in range(layout.num_rings)]
