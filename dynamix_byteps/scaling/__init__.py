"""Optimizer statistics for batch-size changes: the gradient noise scale and the LR scaling rules."""
