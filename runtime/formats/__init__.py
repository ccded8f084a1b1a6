"""Exact codecs of the expert weight and activation formats (docs/runtime.md, "Run formats")."""

# The quant segment of an implementation id, in the order of the docs' table.
RUN_FORMATS = ("bf16", "fp8_block_scales", "w4a16_mxfp4", "w4a8_mxfp4_fp8", "w4a8_mxfp4_mxfp8",
               "w4a16_nvfp4", "nvfp4")
