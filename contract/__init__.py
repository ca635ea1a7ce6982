"""What the coordinator, the rollout services and the trainer share, importable without torch.

Run-spec schemas (the trainer's run config, the engines' options), platform
names, the GRPO advantage and the tensor wire format. Modules here import
pydantic, numpy and the proto stubs only, so the control plane runs in a
process without torch; the torch-side modules import their settings from here.
"""
