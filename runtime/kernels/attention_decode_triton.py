"""The Triton kernels of `runtime.kernels.attention_decode` (imported only where Triton is; module level, so the
kernel can call its mask helper by name)."""
import triton
import triton.language as tl

from runtime.kernels.attention_mask_triton import visible


@triton.jit
def decode_partials(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, acc_ptr,
                    kv_heads, length, window, scale,
                    q_b, q_h, k_b, k_h, k_l, v_b, v_h, v_l,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    WINDOW: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = (bh // kv_heads).to(tl.int64)
    h = (bh % kv_heads).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, DIM)
    # The G query heads of this key/value head (rows h*G .. h*G+G-1, repeat_kv order), padded to G_PAD.
    q = tl.load(q_ptr + b * q_b + (h * GROUP + g)[:, None] * q_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    p_q = tl.load(qpos_ptr)
    blocks = tl.cdiv(length, BLOCK_N)
    per = tl.cdiv(blocks, splits)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, DIM], dtype=tl.float32)
    # This split's blocks of BLOCK_N slots, with a running (online) softmax over them.
    for blk in range(split * per, tl.minimum(split * per + per, blocks)):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        in_len = n < length
        k = tl.load(k_ptr + b * k_b + h * k_h + n[:, None] * k_l + d[None, :], mask=in_len[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        p_k = tl.load(kpos_ptr + n, mask=in_len, other=0)
        s = tl.where(visible(p_q, p_k, in_len, window, WINDOW)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + b * v_b + h * v_h + n[:, None] * v_l + d[None, :], mask=in_len[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row = (bh * GROUP + g).to(tl.int64) * splits + split
    real = g < GROUP
    tl.store(m_ptr + row, m_i, mask=real)
    tl.store(l_ptr + row, l_i, mask=real)
    tl.store(acc_ptr + row[:, None] * DIM + d[None, :], acc, mask=real[:, None])


@triton.jit
def decode_combine(m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, kv_heads, splits,
                   GROUP: tl.constexpr, G_PAD: tl.constexpr, DIM: tl.constexpr, CHUNK: tl.constexpr,
                   SINKS: tl.constexpr):
    bhq = tl.program_id(0)          # b * Hq + query head
    q_heads = kv_heads * GROUP
    b = bhq // q_heads
    hq = bhq % q_heads
    h = hq // GROUP
    g = hq % GROUP
    d = tl.arange(0, DIM)
    base = ((b * kv_heads + h) * GROUP + g).to(tl.int64) * splits
    top = tl.full([], float("-inf"), tl.float32)
    for start in range(0, splits, CHUNK):
        i = start + tl.arange(0, CHUNK)
        top = tl.maximum(top, tl.max(tl.load(m_ptr + base + i, mask=i < splits, other=float("-inf")), axis=0))
    if SINKS:
        # The sink logit joins the softmax's normaliser and is then dropped (gpt-oss).
        sink = tl.load(sink_ptr + hq).to(tl.float32)
        top = tl.maximum(top, sink)
    total = tl.full([], 0.0, tl.float32)
    out = tl.zeros([DIM], dtype=tl.float32)
    for start in range(0, splits, CHUNK):
        i = start + tl.arange(0, CHUNK)
        valid = i < splits
        m = tl.load(m_ptr + base + i, mask=valid, other=float("-inf"))
        l = tl.load(l_ptr + base + i, mask=valid, other=0.0)
        w = tl.where(valid & (m > float("-inf")), tl.exp(m - top), 0.0)
        total += tl.sum(w * l, axis=0)
        acc = tl.load(acc_ptr + (base + i)[:, None] * DIM + d[None, :], mask=valid[:, None], other=0.0)
        out += tl.sum(acc * w[:, None], axis=0)
    if SINKS:
        total += tl.exp(sink - top)
    tl.store(out_ptr + bhq.to(tl.int64) * DIM + d, (out / total).to(out_ptr.dtype.element_ty))
