"""The on-disk format: index, sidecars, tar layouts, image headers, conversations (no torch)."""
