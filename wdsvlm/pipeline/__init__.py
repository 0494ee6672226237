"""The pipeline stages: sources, plan, read, shuffle, images, tokenize, pack, collate."""
