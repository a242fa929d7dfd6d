"""The systems model: pure Python, importing it must not import torch."""
