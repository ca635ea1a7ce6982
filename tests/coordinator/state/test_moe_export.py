"""The coordinator exports an MoE step's routing metrics: the scalar ones as lockstep_step_moe_*, routing
agreement per layer under a `layer` label; a dense run's step exports none of them."""
from __future__ import annotations

from services.coordinator.state.exporter import CoordinatorExporter


def test_moe_step_metrics_are_exported_with_a_layer_label():
    exporter = CoordinatorExporter()
    exporter.on_step("moe", 3, {"loss": 0.5, "moe_expert_load_max": 40.0, "moe_expert_load_mean": 12.5,
                                "moe_dropped_tokens": 0.0, "moe_router_entropy": 1.9,
                                "moe_routing_agreement_layer_0": 1.0, "moe_routing_agreement_layer_1": 0.75,
                                "moe_routing_agreement_min": 0.75}, {})
    exporter.on_step("dense", 3, {"loss": 0.25}, {})
    value = exporter.registry.get_sample_value
    assert value("lockstep_step_moe_expert_load_max", {"run_id": "moe"}) == 40.0
    assert value("lockstep_step_moe_router_entropy", {"run_id": "moe"}) == 1.9
    assert value("lockstep_step_moe_routing_agreement_min", {"run_id": "moe"}) == 0.75
    assert value("lockstep_step_moe_routing_agreement", {"run_id": "moe", "layer": "1"}) == 0.75
    assert value("lockstep_step_moe_routing_agreement", {"run_id": "moe", "layer": "0"}) == 1.0
    assert value("lockstep_step_moe_expert_load_max", {"run_id": "dense"}) is None
