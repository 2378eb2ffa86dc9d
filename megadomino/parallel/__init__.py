"""Fused sequence-parallel communication (`async_tp`), until it moves to `megadomino/overlap/`."""
