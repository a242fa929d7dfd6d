"""paratrain: train decoder LMs with every classic form of parallelism, and predict
what the same plan costs at scale."""

__version__ = "0.1.0"
