"""Trainer attention plugin for tests: registers the boundary-blind attention, mis-declared as honouring boundaries."""
from kernels.attention import REGISTRY
from tests.support.boundary_blind_attention import backend

REGISTRY.register(backend(honours_boundaries=True), replace=True)
