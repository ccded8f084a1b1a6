"""Reading HF-layout checkpoints (config, safetensors, quant metadata) into a build.

`CheckpointReader` lists and reads lazily; `experts_source` gives one MoE layer's experts in the
canonical per-expert form whatever the family's layout; `load_checkpoint` validates everything
(`check_checkpoint` does that alone, from the headers), then fills a build's parameters and its experts modules. All failures are `CheckpointError`.
"""
from runtime.checkpoint.errors import CheckpointConfigError, CheckpointError
from runtime.checkpoint.experts_sources import (LAYOUTS, GptOssFusedSource, PerExpertSource, detect_layout,
                                                experts_source)
from runtime.checkpoint.loader import LoadReport, check_checkpoint, find_experts_modules, load_checkpoint
from runtime.checkpoint.reader import CheckpointReader, TensorInfo, opened

__all__ = ["CheckpointConfigError", "CheckpointError", "CheckpointReader", "GptOssFusedSource", "LAYOUTS", "LoadReport", "PerExpertSource",
           "TensorInfo", "check_checkpoint", "detect_layout", "experts_source", "find_experts_modules", "load_checkpoint", "opened"]
