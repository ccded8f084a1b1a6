"""Model ops that generated builds assemble: norms, rotary, attention, MLPs, MoE block, MTP, heads."""
