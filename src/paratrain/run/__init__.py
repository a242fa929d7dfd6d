"""The run path: the launcher, a torchrun worker, stopping on signals, the training loop,
TensorBoard events, the check-model grid and sampling from a trained model."""
