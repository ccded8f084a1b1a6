"""Experts implementations, one class per registry id; base.py holds the shared contract."""
from .cupy_mma import CUPY_EXPERTS
from .torch_grouped import TORCH_EXPERTS
from .triton_grouped import TRITON_EXPERTS
from .vanilla import VANILLA_EXPERTS

# Every experts class; the registry's runtime-class entries are checked against it both ways.
ALL_EXPERTS = VANILLA_EXPERTS + TORCH_EXPERTS + CUPY_EXPERTS + TRITON_EXPERTS
