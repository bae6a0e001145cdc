"""Distributed training: strategies, launch and the memory estimator."""
