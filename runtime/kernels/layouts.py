"""Weight layouts the CUPY kernels read, made once at load from the canonical checkpoint tensors.

Plain torch (no GPU, no cupy), so CPU tests can check them against the formats' codecs. Three changes
from the checkpoint layout, all free at run time and exact:

* gate and up rows interleaved in blocks of 8 (`interleave_gate_up`): one 16-row MMA tile holds 8
  gate rows and the 8 matching up rows, so the GLU activation happens in the GEMM's registers.
* FP4 (E2M1) codes moved to other bit positions inside each 32-bit word of 8 elements
  (`relayout_fp4`): a word is turned into MMA operands with a few shifts and masks instead of a
  per-nibble table lookup (moe_kernels.cu: fp4_to_bf16x8, fp4_to_e4m3x8).
* FP4 rows and their block scales stored in tiles of 16 rows x 64 K elements (`tile_rows`): the 16 rows
  of one MMA tile read each 64-element chunk as 512 contiguous bytes (and its scales as 32 or 64) instead
  of 16 pieces, one per row, and a run of chunks of one tile is one contiguous span (a bulk copy).
"""
from __future__ import annotations

import torch

# BF16_WORD: element i of a word (8 consecutive K elements of one lane) feeds bf16x2 pair i // 2,
# low half for even i. Its 3 magnitude bits (exponent, mantissa) must land on bf16 bits 8..6 (22..24
# for the high half) and its sign on bit 15 (31). Pair j's magnitude fields are stored 3*j bits
# higher (j = 3: 3 bits lower) and the signs fill the 8 bits left over.
_BF16_MAG_SHIFT = (0, 3, 6, -3)
_BF16_SIGN_SHIFT = (0, -15, -14, -13)
BF16_WORD = tuple(
    ((6 if i % 2 == 0 else 22) + _BF16_MAG_SHIFT[i // 2], (15 if i % 2 == 0 else 31) + _BF16_SIGN_SHIFT[i // 2])
    for i in range(8))
# E4M3_WORD: elements 0..3 become the E4M3 bytes of one register, 4..7 of another. Magnitudes of the
# first four sit in place (bits 8k+2..8k+4), those of the last four 3 bits higher; signs in bits
# 8k (first four) and 8k+1 (last four).
E4M3_WORD = tuple((8 * (i % 4) + (5 if i >= 4 else 2), 8 * (i % 4) + (1 if i >= 4 else 0)) for i in range(8))
# The masks a BF16_WORD decode keeps of each shifted word (moe_kernels.cu fp4_to_bf16x8, fp4_blocks.fp4_block,
# decode_bf16_word): the magnitude fields (bf16 bits 8..6, 24..22), the signs (bits 15, 31).
BF16_WORD_MAG, BF16_WORD_SIGN = 0x01C001C0, 0x80008000
# w4a8 runs one E4M3 MMA step (32 K elements, one MX scale block) per word: lane t's two words of a
# 64-element chunk are elements 8t..8t+7 of each 32-block, stored next to each other.
_W4A8_WORD_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)   # stored word d of a chunk <- canonical word


def relayout_fp4(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """Canonical packed E2M1 (uint8 [..., K/2], element 2i in the low nibble) -> the kernel layout
    `"bf16"` (w4a16 formats) or `"e4m3"` (w4a8), same shape and dtype. K must be a multiple of 64."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 32:
        raise ValueError(f"relayout_fp4 needs uint8 [..., K/2] with K % 64 == 0, got {tuple(packed.shape)} "
                         f"{packed.dtype}")
    table = {"bf16": BF16_WORD, "e4m3": E4M3_WORD}[layout]
    words = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    new = torch.zeros_like(words)
    for i, (mag_pos, sign_pos) in enumerate(table):
        code = (words >> (4 * i)) & 0xF
        new |= (code & 7) << mag_pos
        new |= (code >> 3) << sign_pos
    if layout == "e4m3":
        new = w4a8_stored_order(new, word=1)
    new = torch.where(new >= 2 ** 31, new - 2 ** 32, new).to(torch.int32)
    return new.view(torch.uint8).reshape(packed.shape)


def w4a8_stored_order(x: torch.Tensor, word: int = 8) -> torch.Tensor:
    """x [..., N] with each 64-element K chunk's eight words (8 elements each; `word` entries of x a word: 8 for an
    entry per element, 1 for packed words) in w4a8's stored order (`_W4A8_WORD_ORDER`): the order `relayout_fp4`
    gives its e4m3 words, and the order quant_fp8_rows writes W4A8's activation codes in, so the GEMMs multiply
    both as they lie. Same shape."""
    *lead, n = x.shape
    if n % (8 * word):
        raise ValueError(f"w4a8_stored_order needs whole 64-element chunks: {n} entries of {word} a word")
    return x.reshape(*lead, n // (8 * word), 8, word)[..., list(_W4A8_WORD_ORDER), :].reshape(x.shape)


def tile_rows(packed: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Bytes [..., N, B] of N rows, `chunk_bytes` per 64-element K chunk (32: packed FP4 weights; 2 or 4: their
    MXFP4 or NVFP4 block scales) -> the same bytes in tiles: tile (b, c), 16 * chunk_bytes contiguous bytes,
    holds chunk c of rows 16b..16b+15 in row order, tiles c = 0.. of row block b one after another (row block b
    is still bytes 16b * B .. 16(b+1) * B). Same shape."""
    *lead, n, kb = packed.shape
    if packed.dtype != torch.uint8 or n % 16 or kb % chunk_bytes:
        raise ValueError(f"tile_rows needs uint8 [..., N, B] with N % 16 == 0 and B a whole number of "
                         f"{chunk_bytes}-byte K chunks, got {tuple(packed.shape)} {packed.dtype}")
    tiles = packed.reshape(*lead, n // 16, 16, kb // chunk_bytes, chunk_bytes).transpose(-3, -2)
    return tiles.contiguous().reshape(packed.shape)


def decode_bf16_word(word):
    """What moe_kernels.cu's fp4_to_bf16x8 makes of one 32-bit word: 4 bf16x2 bit patterns (for tests;
    `word` may be an int or an int64 / uint64 numpy array of words, decoded elementwise)."""
    mag, sgn, m = BF16_WORD_MAG, BF16_WORD_SIGN, 0xFFFFFFFF
    x = word & m
    return [x & (mag | sgn),
            ((x >> 3) & mag) | ((x << 15) & sgn & m),
            ((x >> 6) & mag) | ((x << 14) & sgn & m),
            ((x << 3) & mag & m) | ((x << 13) & sgn & m)]


def decode_e4m3_word(word: int) -> tuple[int, int]:
    """What fp4_to_e4m3x8 makes of one word: two registers of 4 E4M3 bytes (for tests)."""
    mag, sgn, m = 0x1C1C1C1C, 0x80808080, 0xFFFFFFFF
    x = word & m
    return (x & mag) | ((x << 7) & sgn & m), ((x >> 3) & mag) | ((x << 6) & sgn & m)


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[n, I, ...] gate and up -> [n, 2I, ...] with rows 16r..16r+7 = gate 8r..8r+7 and
    16r+8..16r+15 = up 8r..8r+7 (I % 8 == 0)."""
    n, i, *rest = gate.shape
    if i % 8:
        raise ValueError(f"gate/up interleaving needs an intermediate size divisible by 8, got {i}")
    blocks = torch.stack((gate.reshape(n, i // 8, 8, *rest), up.reshape(n, i // 8, 8, *rest)), dim=2)
    return blocks.reshape(n, 2 * i, *rest)
