"""Model families: the default tiling, Qwen2/2.5/3-VL, SmolVLM/Idefics3, model_inputs."""
