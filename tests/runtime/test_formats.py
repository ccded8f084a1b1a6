"""Codecs against oracles nobody here wrote: ml_dtypes' E2M1/E4M3/E8M0, transformers' MXFP4 unpacking
(gpt-oss layout), and float64 evaluations of the documented formulas for the scaled formats."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from runtime.formats import act_quant, fp4, fp8, mxfp4, mxfp8, nvfp4


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _wide_random(shape, seed):
    """Magnitudes spread over many binades, both signs, plus no zeros."""
    g = _gen(seed)
    mag = torch.exp2(torch.empty(shape).uniform_(-12, 10, generator=g))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return mag * sign


def _e2m1_oracle_codes(x: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' float4_e2m1fn cast (RNE, saturating) as 4-bit codes."""
    codes = x.numpy().astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    return torch.from_numpy(codes.astype(np.uint8))


def _e4m3_oracle(x: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' float8_e4m3fn cast of fp32 values (which must be within +-448), as fp32."""
    assert x.abs().max() <= 448
    return torch.from_numpy(x.numpy().astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


# --- E2M1 -------------------------------------------------------------------------------------------

def test_e2m1_table_matches_ml_dtypes():
    oracle = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ours = fp4.e2m1_table().numpy()
    assert np.array_equal(ours, oracle)
    assert np.array_equal(np.signbit(ours), np.signbit(oracle))   # code 8 is -0


def test_e2m1_rounding_matches_ml_dtypes_on_random_values_and_every_tie():
    x = torch.cat([
        torch.empty(20000).uniform_(-8, 8, generator=_gen(1)),
        _wide_random((5000,), 2),
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e6]),
        -torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e6]),
    ])
    assert torch.equal(fp4.quantize_e2m1(x), _e2m1_oracle_codes(x))


def test_e2m1_ties_go_to_even_codes():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = fp4.e2m1_table()[fp4.quantize_e2m1(ties).long()]
    assert values.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp4_nibble_order_first_element_low():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(fp4.unpack_fp4(packed), codes)
    assert fp4.dequantize_e2m1(packed).tolist() == [[0.5, 1.0, -6.0, -0.0]]


def test_fp4_pack_unpack_round_trip_random():
    codes = torch.randint(0, 16, (7, 3, 64), generator=_gen(3), dtype=torch.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.shape == (7, 3, 32)
    assert torch.equal(fp4.unpack_fp4(packed), codes)
    assert torch.equal(fp4.dequantize_e2m1(packed), fp4.e2m1_table()[codes.long()])


# --- E8M0 and MXFP4 ---------------------------------------------------------------------------------

def test_e8m0_table_matches_ml_dtypes_including_nan():
    oracle = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = mxfp4.e8m0_table().numpy()
    assert np.isnan(ours[0xFF]) and np.isnan(oracle[0xFF])
    assert np.array_equal(ours[:255], oracle[:255])


def test_mxfp4_dequant_matches_transformers_on_gpt_oss_layout():
    g = _gen(4)
    experts, rows, groups = 3, 24, 4        # K = 4 * 32 = 128
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (experts, rows, groups), generator=g, dtype=torch.uint8)
    oracle = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)   # [E, K, rows]
    ours = mxfp4.dequantize_mxfp4(mxfp4.gpt_oss_blocks_to_canonical(blocks), scales)   # [E, rows, K]
    assert ours.shape == (experts, rows, groups * 32)
    assert torch.equal(ours.transpose(1, 2), oracle)


def test_gpt_oss_block_layout_helpers_are_inverse():
    packed = torch.randint(0, 256, (5, 64), generator=_gen(5), dtype=torch.uint8)
    blocks = mxfp4.canonical_to_gpt_oss_blocks(packed)
    assert blocks.shape == (5, 4, 16)
    assert torch.equal(mxfp4.gpt_oss_blocks_to_canonical(blocks), packed)


def test_mxfp4_scale_byte_ff_is_nan():
    packed = torch.randint(0, 256, (2, 32), generator=_gen(6), dtype=torch.uint8)
    scales = torch.tensor([[127, 0xFF], [0xFF, 120]], dtype=torch.uint8)
    out = mxfp4.dequantize_mxfp4(packed, scales)
    assert out[0, 32:].isnan().all() and out[1, :32].isnan().all()
    assert not out[0, :32].isnan().any() and not out[1, 32:].isnan().any()


def _floor_rule_scale(amax: np.ndarray, emax: int) -> np.ndarray:
    """float64 oracle of the OCP scale: 2^(floor(log2 amax) - emax)."""
    return np.exp2(np.floor(np.log2(amax)) - emax)


def test_mxfp4_quantizer_follows_ocp_floor_rule():
    w = _wide_random((16, 256), 7) * torch.rand(16, 1, generator=_gen(8))
    packed, bits = mxfp4.quantize_mxfp4(w)
    blocks = w.double().reshape(16, 8, 32)
    scale = _floor_rule_scale(blocks.abs().amax(-1).numpy(), 2)
    assert np.array_equal(mxfp4.e8m0_to_float(bits).double().numpy(), scale)
    codes = _e2m1_oracle_codes((blocks / torch.from_numpy(scale)[..., None]).float().reshape(16, 256))
    assert torch.equal(fp4.unpack_fp4(packed), codes)


# --- MXFP8 ------------------------------------------------------------------------------------------

def test_mxfp8_against_float64_formula():
    x = torch.randn(12, 96, generator=_gen(9)) * torch.exp2(torch.randint(-6, 6, (12, 1), generator=_gen(10)))
    q, bits = mxfp8.quantize_mxfp8(x)
    blocks = x.double().reshape(12, 3, 32)
    scale = _floor_rule_scale(blocks.abs().amax(-1).numpy(), 8)
    assert np.array_equal(mxfp4.e8m0_to_float(bits).double().numpy(), scale)
    scaled = (blocks / torch.from_numpy(scale)[..., None]).clamp(-448, 448).float().reshape(12, 96)
    assert torch.equal(q.float(), _e4m3_oracle(scaled))
    expected = (_e4m3_oracle(scaled).double().reshape(12, 3, 32) * torch.from_numpy(scale)[..., None]).reshape(12, 96)
    assert torch.equal(mxfp8.qdq_mxfp8(x).double(), expected)
    # the floor rule lets a block's largest elements reach 512 > 448: they saturate
    assert (q.float().abs() == 448).any()


# --- FP8 blocks and groups ----------------------------------------------------------------------------

def test_e4m3_cast_matches_ml_dtypes_and_saturates():
    x = torch.empty(20000).uniform_(-448, 448, generator=_gen(11)) * torch.rand(20000, generator=_gen(12)) ** 4
    assert torch.equal(fp8.to_e4m3(x).float(), _e4m3_oracle(x))
    assert fp8.to_e4m3(torch.tensor([1e6, -500.0])).float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (5, 130)])
def test_fp8_weight_blocks_against_float64(shape):
    out_dim, in_dim = shape
    w = torch.randn(shape, generator=_gen(13)) * torch.exp2(torch.randint(-4, 4, (out_dim, 1), generator=_gen(14)))
    q, scale = fp8.quantize_weight_blocks(w)
    assert scale.shape == (math.ceil(out_dim / 128), math.ceil(in_dim / 128)) and scale.dtype == torch.float32
    # per-block amax / 448, the edge blocks over their real (unpadded) elements
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            assert scale[bi, bj].item() == np.float32(block.abs().max().item() / 448.0)
    expanded = scale.double().repeat_interleave(128, 0)[:out_dim].repeat_interleave(128, 1)[:, :in_dim]
    assert torch.equal(q.float(), _e4m3_oracle((w / expanded.float()).clamp(-448, 448)))
    ref = (q.double() * expanded).float()       # one rounding of the exact product
    assert torch.equal(fp8.dequantize_weight_blocks(q, scale), ref)
    assert torch.equal(fp8.dequantize_weight_blocks(q, scale, torch.bfloat16), ref.bfloat16())


def test_fp8_weight_blocks_dequant_stacked_and_shape_checked():
    q, scale = fp8.quantize_weight_blocks(torch.randn(3, 130, 260, generator=_gen(15)))
    assert scale.shape == (3, 2, 3)
    each = torch.stack([fp8.dequantize_weight_blocks(q[i], scale[i]) for i in range(3)])
    assert torch.equal(fp8.dequantize_weight_blocks(q, scale), each)
    with pytest.raises(ValueError, match=r"block scales \(3, 2, 2\) do not match weight \(3, 130, 260\)"):
        fp8.dequantize_weight_blocks(q, scale[..., :2])


def test_fp8_activation_groups_against_float64_with_partial_group_and_floor():
    x = torch.randn(6, 300, generator=_gen(16)) * 3
    x[2, 128:256] = 0          # a zero group: amax floored at 1e-4
    x[3, 256:] *= 1e-7         # a tiny remainder group: floored as well
    q, scale = fp8.quantize_act_groups(x)
    assert scale.shape == (6, 3)
    groups = [x[:, :128], x[:, 128:256], x[:, 256:]]
    ref_scale = torch.stack([torch.from_numpy(np.maximum(gr.double().abs().amax(1).numpy(), 1e-4) / 448)
                             for gr in groups], dim=1)
    assert torch.equal(scale, ref_scale.float())
    expanded = torch.cat([scale[:, i:i + 1].expand(-1, gr.shape[1]) for i, gr in enumerate(groups)], dim=1)
    assert torch.equal(q.float(), _e4m3_oracle((x / expanded).clamp(-448, 448)))
    assert torch.equal(fp8.qdq_act_groups(x), (q.double() * expanded.double()).float())
    assert (fp8.qdq_act_groups(x)[2, 128:256] == 0).all()


def test_fp8_per_token_against_float64():
    x = torch.randn(9, 72, generator=_gen(17)) * torch.exp2(torch.randint(-5, 5, (9, 1), generator=_gen(18)))
    q, scale = fp8.quantize_act_per_token(x)
    ref_scale = np.maximum(x.double().abs().amax(1, keepdim=True).numpy(), 1e-4) / 448
    assert torch.equal(scale, torch.from_numpy(ref_scale).float())
    assert torch.equal(q.float(), _e4m3_oracle((x / scale).clamp(-448, 448)))
    assert torch.equal(fp8.qdq_act_per_token(x), (q.double() * scale.double()).float())


# --- NVFP4 --------------------------------------------------------------------------------------------

def _nvfp4_reference(x: torch.Tensor, g: float):
    """float64 evaluation of ModelOpt's NVFP4 formulas: (codes, block scales fp32, dequantized fp32)."""
    blocks = x.double().reshape(*x.shape[:-1], -1, 16)
    per_block = blocks.abs().amax(-1) / (6 * g)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    bs = _e4m3_oracle(per_block.clamp(2.0 ** -9, 448).float())
    codes = _e2m1_oracle_codes((blocks / (bs.double() * g)[..., None]).float().reshape(x.shape))
    values = fp4.e2m1_table(torch.float64)[codes.long()].reshape(blocks.shape)
    deq = (values * bs.double()[..., None] * g).reshape(x.shape).float()
    return codes, bs, deq


def test_nvfp4_weight_against_float64_formulas():
    w = torch.randn(24, 96, generator=_gen(19)) * torch.exp2(torch.randint(-10, 3, (24, 1), generator=_gen(20)))
    w[3, 16:32] = 0                       # a zero block gets scale 1.0
    w[5] *= 1e-7                          # blocks far below the tensor amax: scale clamped at 2^-9
    packed, scale, scale_2 = nvfp4.quantize_nvfp4_weight(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (24, 6)
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    assert scale_2.item() == np.float32(w.double().abs().max().item() / (6 * 448))
    codes, bs, deq = _nvfp4_reference(w, scale_2.item())
    assert scale[3, 1].float().item() == 1.0
    assert (scale[5].float() == 2.0 ** -9).all()
    assert torch.equal(scale.float(), bs)
    assert torch.equal(fp4.unpack_fp4(packed), codes)
    assert torch.equal(nvfp4.dequantize_nvfp4(packed, scale, scale_2), deq)


def test_nvfp4_dequant_of_stacked_weights_takes_per_expert_global_scales():
    ws = torch.randn(3, 8, 32, generator=_gen(21))
    parts = [nvfp4.quantize_nvfp4_weight(ws[i]) for i in range(3)]
    stacked = nvfp4.dequantize_nvfp4(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                                     torch.stack([p[2] for p in parts]))
    assert torch.equal(stacked, torch.stack([nvfp4.dequantize_nvfp4(*p) for p in parts]))


def test_nvfp4_activation_with_static_input_scale_saturates_above_calibration():
    x = torch.randn(10, 64, generator=_gen(22)) * 2
    input_scale = float(np.float32(2.5 / (6 * 448)))      # calibrated below this batch's amax
    codes, bs, deq = _nvfp4_reference(x, input_scale)
    assert torch.equal(nvfp4.qdq_nvfp4_activation(x, input_scale), deq)
    assert (bs == 448).any()                               # block scale clamped ...
    assert (codes & 7 == 7).any()                          # ... and elements saturated at 6


# --- run-format dispatch ----------------------------------------------------------------------------

def test_act_quant_dispatches_each_run_format():
    x = torch.randn(4, 128, generator=_gen(23)).bfloat16()
    for fmt in ("bf16", "w4a16_mxfp4", "w4a16_nvfp4"):
        out = act_quant.quantize_dequantize_activation(x, fmt)
        assert out.dtype == torch.float32 and torch.equal(out, x.float())
    cases = {"fp8_block_scales": fp8.qdq_act_groups(x), "w4a8_mxfp4_fp8": fp8.qdq_act_per_token(x),
             "w4a8_mxfp4_mxfp8": mxfp8.qdq_mxfp8(x), "nvfp4": nvfp4.qdq_nvfp4_activation(x, 0.002)}
    for fmt, expected in cases.items():
        out = act_quant.quantize_dequantize_activation(x, fmt, input_scale=0.002)
        assert torch.equal(out, expected), fmt
        assert not torch.equal(out, x.float()), fmt


def test_act_quant_errors():
    x = torch.randn(2, 32, generator=_gen(24))
    with pytest.raises(ValueError) as err:
        act_quant.quantize_dequantize_activation(x, "nvfp4")
    assert str(err.value) == ("run format nvfp4 quantizes activations with the checkpoint's static "
                              "input_scale; none was given")
    with pytest.raises(ValueError) as err:
        act_quant.quantize_dequantize_activation(x, "int4")
    assert str(err.value) == ("unknown run format 'int4'; known: bf16, fp8_block_scales, w4a16_mxfp4, "
                              "w4a8_mxfp4_fp8, w4a8_mxfp4_mxfp8, w4a16_nvfp4, nvfp4")
