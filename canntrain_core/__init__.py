"""canntrain: training recipes for Ascend NPUs, CUDA and CPU. Notebooks import from here."""

import os

# canntrain never downloads at run time: set before anything imports huggingface_hub, which reads it once at import
# (transformers, datasets, peft, and bitsandbytes' hub kernels then stay offline); a value the user set wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

__version__ = "0.1.0"
