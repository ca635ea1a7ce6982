"""Lockstep on a Ray cluster: `python -m services.ray_stack` (see launcher.py)."""
