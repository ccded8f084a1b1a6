"""The weight layouts of the CUPY kernels, checked on the CPU: FP4 words re-laid at load and decoded
the way moe_kernels.cu decodes them give back the checkpoint's E2M1 values at the K positions the
kernels pair them with, gate/up interleaving puts 8 gate rows above their 8 up rows, and FP4 rows tiled by
16 x 64 put each m-tile's chunk in 512 contiguous bytes."""
import struct

import pytest
import torch

from runtime.formats import fp4
from runtime.kernels.layouts import decode_bf16_word, decode_e4m3_word, interleave_gate_up, relayout_fp4, tile_rows


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _e4m3(byte: int) -> float:
    e, m = (byte >> 3) & 15, byte & 7
    v = 2.0 ** (e - 7) * (1 + m / 8) if e else m * 2.0 ** -9
    return -v if byte & 0x80 else v


def _packed(rows, k, seed):
    codes = torch.randint(0, 16, (rows, k), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)      # every code, zeros of both signs included
    return fp4.pack_fp4(codes), fp4.e2m1_table()[codes.long()]


def test_bf16_words_decode_to_the_e2m1_values_in_k_order():
    packed, values = _packed(3, 128, seed=1)
    words = relayout_fp4(packed, "bf16").contiguous().view(torch.int32)
    for r in range(3):
        for w in range(words.shape[1]):
            pairs = decode_bf16_word(int(words[r, w]) & 0xFFFFFFFF)
            got = [v * 2.0 ** 126 for p in pairs for v in (_bf16(p), _bf16(p >> 16))]
            assert got == values[r, 8 * w:8 * w + 8].tolist(), (r, w)


def test_e4m3_words_decode_to_the_e2m1_values_of_each_mx_block():
    packed, values = _packed(2, 192, seed=2)
    words = relayout_fp4(packed, "e4m3").contiguous().view(torch.int32)
    for r in range(2):
        for chunk in range(192 // 64):
            for t in range(4):
                for s in range(2):   # MMA step s = MX block s of the chunk; lane t owns elements 8t..8t+7
                    lo, hi = decode_e4m3_word(int(words[r, 8 * chunk + 2 * t + s]) & 0xFFFFFFFF)
                    got = [_e4m3((reg >> (8 * b)) & 0xFF) * 2.0 ** 6 for reg in (lo, hi) for b in range(4)]
                    first = 64 * chunk + 32 * s + 8 * t
                    assert got == values[r, first:first + 8].tolist(), (r, chunk, t, s)


def test_interleave_gate_up():
    gate = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    up = -gate
    both = interleave_gate_up(gate, up)
    assert both.shape == (2, 32, 3)
    assert torch.equal(both[:, 0:8], gate[:, 0:8]) and torch.equal(both[:, 8:16], up[:, 0:8])
    assert torch.equal(both[:, 16:24], gate[:, 8:16]) and torch.equal(both[:, 24:32], up[:, 8:16])


def test_bf16_decode_is_exact_for_every_code_combination():
    """All 2^16 code combinations of each half word (elements 0..3 and 4..7): re-laid, decoded the kernel's
    way (shifts and masks) and scaled by 2^126, they are ml_dtypes' float4_e2m1fn values."""
    import ml_dtypes
    import numpy as np

    combos = np.arange(1 << 16, dtype=np.uint32)
    nibbles = (combos[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 0xF          # [65536, 4]
    codes = np.concatenate([nibbles, nibbles[::-1]], axis=1).astype(np.uint8)           # [65536, 8]
    packed = fp4.pack_fp4(torch.from_numpy(codes))                                       # [65536, 4]
    packed = torch.cat([packed, torch.zeros(1 << 16, 28, dtype=torch.uint8)], 1)          # one 64-chunk row
    words = relayout_fp4(packed, "bf16").view(torch.int32)[:, 0].numpy().astype(np.int64) & 0xFFFFFFFF
    pairs = np.stack(decode_bf16_word(words), axis=1).astype(np.uint64)                  # [65536, 4]
    halves = np.stack([pairs & 0xFFFF, pairs >> 16], axis=2).reshape(-1, 8)               # element order
    got = (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64) * 2.0 ** 126
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    assert np.array_equal(got, expected)
    assert np.array_equal(np.signbit(got), np.signbit(expected))                         # -0 stays -0


@pytest.mark.parametrize("chunk_bytes", [32, 2, 4], ids=["fp4_weights", "mxfp4_scales", "nvfp4_scales"])
def test_row_tiles_hold_each_m_tile_chunk_in_contiguous_bytes(chunk_bytes):
    n, rows, chunks = 2, 48, 3          # 3 row blocks of 16, 3 chunks of 64 K elements
    packed = torch.randint(0, 256, (n, rows, chunks * chunk_bytes), generator=torch.Generator().manual_seed(3),
                           dtype=torch.uint8)
    tiled = tile_rows(packed, chunk_bytes)
    assert tiled.shape == packed.shape and tiled.dtype == torch.uint8
    flat = tiled.reshape(n, -1)
    tile = 16 * chunk_bytes
    for e in range(n):
        for b in range(rows // 16):
            for c in range(chunks):
                at = (b * chunks + c) * tile          # tile (b, c) of expert e, in row block b's bytes
                for r in range(16):
                    got = flat[e, at + chunk_bytes * r:at + chunk_bytes * (r + 1)]
                    want = packed[e, 16 * b + r, chunk_bytes * c:chunk_bytes * (c + 1)]
                    assert torch.equal(got, want), (e, b, c, r)


@pytest.mark.parametrize("shape", [(2, 40, 96), (2, 32, 80)])
def test_row_tiles_refuse_rows_or_k_off_the_tile(shape):
    with pytest.raises(ValueError) as err:
        tile_rows(torch.zeros(shape, dtype=torch.uint8), 32)
    assert str(err.value) == ("tile_rows needs uint8 [..., N, B] with N % 16 == 0 and B a whole number of 32-byte "
                              f"K chunks, got {shape} torch.uint8")
