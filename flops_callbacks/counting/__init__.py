"""Counting: every aten op of a model's forward, backward and recompute, in flops and MACs, per module."""
