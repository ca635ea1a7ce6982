"""Token log-probabilities: the single definition shared by trainer and rollout engine.

`token_logprobs(logits, targets, ...) -> (logp, lse)`; see kernels/logprob/api.py.
"""
from kernels.logprob.api import token_logprobs, token_logprobs_with_entropy

__all__ = ["token_logprobs", "token_logprobs_with_entropy"]
