"""Seeded token sampling: a counter-based stream per sample and the Gumbel-max draw (torch reference on CPU,
a Triton kernel on GPUs). Row-local, so a sample's tokens never depend on the other rows of a call.

    from kernels.sampling import sample_tokens, seed_words, stream_keys
"""
from kernels.sampling.stream import (
    FMIX_C1,
    FMIX_C2,
    MASK32,
    SEED_SALT,
    TOKEN_MULT,
    fmix32,
    gumbel_argmax_reference,
    keys_at,
    row_keys,
    sample_tokens,
    seed_hashes,
    seed_words,
    stream_keys,
    truncate_logits,
    uniforms,
)

__all__ = ["FMIX_C1", "FMIX_C2", "MASK32", "SEED_SALT", "TOKEN_MULT", "fmix32", "gumbel_argmax_reference",
           "keys_at", "row_keys", "sample_tokens", "seed_hashes", "seed_words", "stream_keys", "truncate_logits", "uniforms"]
