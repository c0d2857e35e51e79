"""Cache policies: frozen, hashable dataclasses (static under `jit`), validated at construction.

Every policy implements the protocol of `jcascade.policies.base.Policy`; one module per family:
window (Full, SlidingWindow, Sink), cascade, h2o, tova, snapkv (SnapKV, PyramidKV), adakv, knorm,
expected_attention, kvzip, recycled. "Writing a
policy" in docs/policies.md shows a new one in a file of its own.
"""

from jcascade.pallas_kernels.schedule import RingLayout
from jcascade.policies.adakv import AdaKV
from jcascade.policies.base import Policy, check_policy
from jcascade.policies.cascade import Cascade
from jcascade.policies.expected_attention import ExpectedAttention
from jcascade.policies.h2o import H2O
from jcascade.policies.knorm import KNorm
from jcascade.policies.kvzip import KVzip
from jcascade.policies.recycled import Recycled
from jcascade.policies.ring import RingPolicy
from jcascade.policies.snapkv import PyramidKV, SnapKV
from jcascade.policies.tova import TOVA
from jcascade.policies.window import Full, Sink, SlidingWindow
from jcascade.policies.spec import parse_policy, policy_classes, spec

__all__ = ["AdaKV", "Cascade", "ExpectedAttention", "Full", "H2O", "KNorm", "KVzip", "Policy", "PyramidKV", "Recycled", "RingLayout", "RingPolicy", "Sink",
           "SlidingWindow", "SnapKV", "TOVA", "check_policy", "parse_policy", "policy_classes", "spec"]
