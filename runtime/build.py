"""What every generated build does when it is constructed: check where it runs, log its implementations
once (RULES LR6), and fill random weights for runs without a checkpoint.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("moegen")
_LOGGED: set[tuple[str, str]] = set()


class PlacementError(RuntimeError):
    """A build constructed where it does not run: another GPU SM, or the CPU with a GPU-only kernel bound."""


def device_sm(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def package_of(owner) -> str:
    """The generated root a build was imported from (`generated`, or a `generate --out` package under
    any name): its classes live at `<root>.<model>.<target or generic>.<file>`."""
    parts = type(owner).__module__.split(".") if owner is not None else []
    return ".".join(parts[:-3]) if len(parts) > 3 else "generated"


def check_placement(target: str, sm: int, device, implementations: dict, cpu_ids: tuple[str, ...], owner=None) -> None:
    """A build runs on a GPU whose SM is its target's, or on the host CPU when every implementation
    bound in it runs there; the meta device (construction without memory) is always allowed. `owner`
    is the module being built: the messages name the package its user loads it through."""
    dev = torch.device(device)
    package = package_of(owner)
    if dev.type == "meta":
        return
    if dev.type == "cpu":
        gpu_only = sorted(i for i in implementations if i not in cpu_ids)
        if gpu_only:
            verb = "does" if len(gpu_only) == 1 else "do"
            raise PlacementError(
                f"{target} is built for sm_{sm} and binds {', '.join(gpu_only)}, which {verb} not run on the host CPU; "
                f"construct it on an sm_{sm} GPU, or load through {package}.load_model with a selection whose "
                "implementations run on the CPU (moe_config.backend TORCH or VANILLA)"
            )
        return
    if dev.type == "cuda":
        here = device_sm(dev)
        if here != sm:
            raise PlacementError(
                f"{target} is built for sm_{sm}, but {dev} is sm_{here}; generate a target for sm_{here} "
                f"(python -m codegen generate --model <model> --sm <sm>) or load through {package}.load_model"
            )
        return
    raise PlacementError(f"{target} runs on an sm_{sm} GPU or the host CPU, not on {dev}")


def check_rank(target: str, world: int, rank: int) -> None:
    if not 0 <= rank < world:
        raise PlacementError(f"{target} has {world} ranks; rank {rank} is not one of them")


def log_implementations(implementations: dict) -> None:
    """LR6: `MoE layers run <class>, MoE implementation id <id> (moe_backend <backend>)`, once per process."""
    for impl_id, (cls, backend) in sorted(implementations.items()):
        key = (cls.__qualname__, impl_id)
        if key in _LOGGED:
            continue
        _LOGGED.add(key)
        log.info("MoE layers run %s, MoE implementation id %s (moe_backend %s)", cls.__name__, impl_id, backend)


def checkpoint_tensors(model: nn.Module):
    """(name, tensor) of every parameter and persistent buffer: what a checkpoint holds for `model`
    (non-persistent buffers, such as rotary frequencies, are computed, never stored or drawn)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        owner, _, local = name.rpartition(".")
        if local not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buffer


def random_values(name: str, shape, gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """Seeded fp32 values for one tensor: normal(0, std), norm weights around 1 (never zeros)."""
    values = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std
    if name.endswith("norm.weight") or "layernorm" in name:
        values += 1.0
    return values


@torch.no_grad()
def init_random(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fresh random weights (never zeros) for runs without a checkpoint: every floating checkpoint
    tensor from `random_values`, and each experts module its own `init_random` (quantized layouts need
    valid codes and scales)."""
    gen = torch.Generator().manual_seed(seed)
    experts = {name for name, mod in model.named_modules() if hasattr(mod, "init_random") and mod is not model}
    for name, tensor in checkpoint_tensors(model):
        if any(name.startswith(prefix + ".") for prefix in experts) or not tensor.is_floating_point():
            continue
        if tensor.device.type == "meta":
            raise RuntimeError("init_random needs a build constructed on a real device, not meta")
        tensor.copy_(random_values(name, tensor.shape, gen, std).to(tensor.device, tensor.dtype))
    for name, mod in model.named_modules():
        if name in experts:
            mod.init_random(gen)


def load_class(path: str) -> type:
    """`package.module:ClassName` -> the class (the generic build binds what resolution names at load)."""
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
