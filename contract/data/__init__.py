"""Contracts of a run's data: the math task's options and file format, prompt dataset blocks, SFT datasets."""
