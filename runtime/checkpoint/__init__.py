"""Reading HF-layout checkpoints (config, safetensors, quant metadata) into a build."""
