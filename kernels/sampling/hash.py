"""The 32-bit integer constants the sampling streams hash with (stream.py gives the definition).

Apart from stream.py so that the Triton kernels, which stream.py imports only on a GPU, read the same
constants without importing it back.
"""

MASK32 = 0xFFFFFFFF
FMIX_C1 = 0x85EBCA6B
"""MurmurHash3 fmix32's first multiplier."""
FMIX_C2 = 0xC2B2AE35
"""MurmurHash3 fmix32's second multiplier."""
SEED_SALT = 0x243F6A88
"""Mixed into the seed's low word before the first fmix32."""
TOKEN_MULT = 0x9E3779B1
"""Spreads token ids over the 32-bit range before they meet the row key."""
