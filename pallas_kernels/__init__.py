"""Attention kernels behind `jcascade.attend` (installed as `jcascade.pallas_kernels`).

`reference` holds the plain-XLA implementations every kernel is tested against.
"""
