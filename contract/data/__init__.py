"""Contracts of a task's prompt data: the math task's options and file format, prompt dataset blocks."""
