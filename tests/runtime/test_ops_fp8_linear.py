"""FP8 block-scaled linears on the CPU: the torch recipe against the float64 oracle, block-aligned tensor-parallel shards
read by the loader as stored, non-finite scales refused, and the tiny deepseek_v3 FP8 build keeping FP8 storage.

Oracle: tests/runtime/helpers_fp8_linear.py (1x128 activation quantization and block dequantization
written out in plain torch). The CPU forward quantizes activations exactly as the oracle does and
multiplies in fp32: relative 1e-6 in fp32 (summation order), bf16 outputs within bf16's rounding (4e-3).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from runtime.checkpoint.errors import CheckpointError
from runtime.checkpoint.loader import load_checkpoint
from runtime.ops.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from tests.runtime.helpers_fp8_linear import quantize_blocks, reference, rel


def _filled(cls, k, n, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    codes, scale = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05)
    layer = cls(in_features=k, out_features=n, **kw)
    with torch.no_grad():
        layer.weight.copy_(codes)
        layer.weight_scale_inv.copy_(scale)
    return layer, codes, scale, gen


@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("k,n", [(256, 384), (320, 200), (64, 128)], ids=str)
@pytest.mark.parametrize("cls", [Fp8ColumnParallelLinear, Fp8RowParallelLinear], ids=lambda c: c.__name__)
def test_the_cpu_forward_is_the_float64_oracle(cls, k, n, m):
    layer, codes, scale, gen = _filled(cls, k, n, seed=m + k + n)
    x = torch.randn(2, m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]
    with torch.no_grad():
        y = layer(x)
        yb = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.float32 and y.shape == (2, m, n)
    assert rel(y, reference(x, codes, scale)) <= 1e-6
    assert yb.dtype == torch.bfloat16
    assert rel(yb, reference(x.to(torch.bfloat16), codes, scale)) <= 4e-3


def test_a_bias_is_added_after_the_product():
    layer, codes, scale, gen = _filled(Fp8ColumnParallelLinear, 256, 128, seed=1, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(128, generator=gen))
        x = torch.randn(4, 256, generator=gen)
        assert rel(layer(x), reference(x, codes, scale) + layer.bias.double()) <= 1e-6


def test_a_split_that_cuts_a_128_block_is_refused():
    with pytest.raises(ValueError) as e:
        Fp8ColumnParallelLinear(in_features=256, out_features=384, tp_rank=0, tp_size=2)
    assert str(e.value) == ("out_features = 384 over 2 tensor-parallel ranks gives 192 per rank, which cuts the "
                            "checkpoint's 128x128 FP8 weight blocks; use a tensor-parallel size that leaves a "
                            "multiple of 128 per rank")
    with pytest.raises(ValueError, match=r"^in_features = 640 over 4 tensor-parallel ranks gives 160 per rank"):
        Fp8RowParallelLinear(in_features=640, out_features=128, tp_rank=1, tp_size=4)


def test_tensor_parallel_shards_load_their_blocks_and_recompose_the_whole(tmp_path):
    gen = torch.Generator().manual_seed(5)
    codes_c, scale_c = quantize_blocks(torch.randn(512, 384, generator=gen))
    codes_r, scale_r = quantize_blocks(torch.randn(200, 512, generator=gen))
    save_file({"col.weight": codes_c, "col.weight_scale_inv": scale_c,
               "row.weight": codes_r, "row.weight_scale_inv": scale_r}, str(tmp_path / "model.safetensors"))
    x = torch.randn(3, 384, generator=gen)
    cols, partial = [], 0
    for rank in range(2):
        model = torch.nn.Module()
        model.col = Fp8ColumnParallelLinear(in_features=384, out_features=512, tp_rank=rank, tp_size=2)
        model.row = Fp8RowParallelLinear(in_features=512, out_features=200, tp_rank=rank, tp_size=2, reduce=False)
        report = load_checkpoint(model, tmp_path)
        assert report.dequantized == [] and model.col.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(model.col.weight_scale_inv, scale_c[2 * rank: 2 * rank + 2])
        assert torch.equal(model.row.weight_scale_inv, scale_r[:, 2 * rank: 2 * rank + 2])
        with torch.no_grad():
            cols.append(model.col(x))
            partial = partial + model.row(torch.randn(3, 256, generator=torch.Generator().manual_seed(rank))
                                          ).double()
    assert rel(torch.cat(cols, -1), reference(x, codes_c, scale_c)) <= 1e-6
    full_in = torch.cat([torch.randn(3, 256, generator=torch.Generator().manual_seed(r)) for r in range(2)], -1)
    assert rel(partial, reference(full_in, codes_r, scale_r)) <= 1e-6


def test_a_nan_block_scale_is_refused_with_its_name(tmp_path):
    codes, scale = quantize_blocks(torch.randn(256, 256))
    scale[1, 0] = float("nan")
    save_file({"lin.weight": codes, "lin.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.lin = Fp8ColumnParallelLinear(in_features=256, out_features=256)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(model, tmp_path)
    assert "lin.weight_scale_inv: 1 of the 4 scale values are NaN or infinite; the checkpoint is corrupt: download " \
           "or quantize it again" in str(e.value)
