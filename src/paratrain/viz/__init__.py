"""Plots and animations written to files (matplotlib, Agg backend)."""
