"""Mixture-of-experts ops: routing with a fixed tie rule and summation order, the grouped expert GEMM
(batch-invariant reference and Triton kernel, torch's grouped matmul for `fast`), and the experts'
fixed-order combination. kernels/batch_invariant/hf.py patches Hugging Face's MoE blocks onto them;
docs/moe.md explains why a token's routing and output are the same bits in any batch."""
from kernels.moe.experts import experts_forward, sort_by_expert
from kernels.moe.grouped import grouped_linear
from kernels.moe.routing import RoutingInputError, route, router_probabilities, routing_stats, top_k_lowest_index

__all__ = ["RoutingInputError", "experts_forward", "grouped_linear", "route", "router_probabilities",
           "routing_stats", "sort_by_expert", "top_k_lowest_index"]
