"""Collective schedules (pure data), the point-to-point executor and a simulator."""
