"""Parallel layouts run for real: gloo ranks on the CPU (issue 5)."""
