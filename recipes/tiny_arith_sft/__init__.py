"""The tiny demo's warm start as an SFT run through the REST API (kind: sft) instead of code.

`prepare.py` writes what `recipes/tiny_arith/prepare.py` starts from, the untrained tiny policy (same
shape, same seed), and the arithmetic task's train split as prompt/completion pairs; recipe.yaml then trains
it with the warm start's settings (batch 64, AdamW lr 2e-3, betas (0.9, 0.99), 20 warmup steps, clip 1.0,
token-mean loss on the answer and eos) through the trainer's `sft` objective.
"""
