"""canntrain: training recipes for Ascend NPUs, CUDA and CPU. Notebooks import from here."""

__version__ = "0.1.0"
