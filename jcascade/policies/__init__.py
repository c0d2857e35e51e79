"""Cache policies: frozen, hashable dataclasses (static under `jit`), validated at construction.

Every policy implements the protocol of `jcascade.policies.base.Policy`, which also holds the bases that declare the
shared fields (`Strided`, `Positioned`, `HeadReduced`); `selection` holds what the compressing policies share
(`ScorerPolicy`, `WindowSelection`); one module per family. `policy_classes()` is the registry of the policies
jcascade exports. "Writing a policy" in docs/policies.md shows a new one in a file of its own.
"""

from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.adakv import AdaKV
from jcascade.policies.base import HeadReduced, Policy, Positioned, Strided, check_policy
from jcascade.policies.cascade import Cascade
from jcascade.policies.expected_attention import ExpectedAttention
from jcascade.policies.h2o import H2O
from jcascade.policies.knorm import KNorm
from jcascade.policies.kvzip import KVzip
from jcascade.policies.recycled import Recycled
from jcascade.policies.ring import RingPolicy
from jcascade.policies.selection import ScorerPolicy, WindowSelection
from jcascade.policies.snapkv import PyramidKV, SnapKV
from jcascade.policies.spec import parse_policy, policy_classes, policy_names, spec
from jcascade.policies.tova import TOVA
from jcascade.policies.window import Full, Sink, SlidingWindow

__all__ = [
    "AdaKV",
    "Cascade",
    "ExpectedAttention",
    "Full",
    "H2O",
    "HeadReduced",
    "KNorm",
    "KVzip",
    "Policy",
    "Positioned",
    "PyramidKV",
    "Recycled",
    "RingLayout",
    "RingPolicy",
    "ScorerPolicy",
    "Sink",
    "SlidingWindow",
    "SnapKV",
    "Strided",
    "TOVA",
    "WindowSelection",
    "check_policy",
    "parse_policy",
    "policy_classes",
    "policy_names",
    "spec",
]
