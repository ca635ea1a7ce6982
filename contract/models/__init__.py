"""Contracts of the model families a run may name: which are covered in which numerics mode, MoE settings."""
