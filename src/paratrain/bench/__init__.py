"""Benchmarks run from the CLI (`paratrain bench ...`)."""
