"""twinkle engine on PyTorch + transformers."""
