"""Supervised fine-tuning runs (`kind: sft`): the dataset reader (dataset.py) and the run's step (step.py)."""
