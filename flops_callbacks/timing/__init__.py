"""Timing: synchronized clocks, the phases of an optimizer step, and per-module latencies."""
