"""dormouse: a trainer for small byte-level language models on the GPUs people own."""

__version__ = "0.1.0"
