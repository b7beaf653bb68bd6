"""Decoupled DiLoCo in JAX: asynchronous, fault-tolerant, low-bandwidth LM pre-training."""
