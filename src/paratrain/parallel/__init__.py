"""Parallelism transforms applied to the plain model on a device mesh."""
