"""The Triton kernel of `runtime.kernels.attention_prefill` (imported only where Triton is; module level, so the
kernel can call its mask helper by name)."""
import triton
import triton.language as tl

from runtime.kernels.attention_mask_triton import visible


@triton.jit
def _key_tiles(q, p_q, acc, l_i, m_i, k_base, v_base, kpos_ptr, first, last, length, window, qk_scale, k_l, v_l,
               d, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, MASKED: tl.constexpr):
    """Key tiles `first .. last-1` into the online softmax; unless MASKED, every row sees every key of them."""
    for t in range(first, last):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            in_len = n < length
            k = tl.load(k_base + n[:, None] * k_l + d[None, :], mask=in_len[:, None], other=0.0)
        else:
            k = tl.load(k_base + n[:, None] * k_l + d[None, :])
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            p_k = tl.load(kpos_ptr + n, mask=in_len, other=0).to(tl.int32)
            scores = tl.where(visible(p_q[:, None], p_k[None, :], in_len[None, :], window, WINDOW), scores,
                              float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row that has seen no key yet keeps m = -inf; exponents then use 0 (all its terms are 0 anyway).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            v = tl.load(v_base + n[:, None] * v_l + d[None, :], mask=in_len[:, None], other=0.0)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = m_new
            v = tl.load(v_base + n[:, None] * v_l + d[None, :])
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def prefill_attention(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, sink_ptr, out_ptr,
                      seq, length, kv_heads, window, qk_scale,
                      q_b, q_s, q_h, k_b, k_h, k_l, v_b, v_h, v_l, o_b, o_s, o_h,
                      GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOW: tl.constexpr, SINKS: tl.constexpr):
    # The latest rows (the most keys without a window) start first, so short tiles fill the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // kv_heads).to(tl.int64)
    h = (bh % kv_heads).to(tl.int64)
    # Rows r = s * GROUP + g: the G query heads of key/value head h at each query s, one K/V tile read for all.
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    real = r < seq * GROUP
    # Padding rows repeat the last query (in bounds, and no change to the tile's position range); never stored.
    s = tl.minimum(r // GROUP, seq - 1).to(tl.int64)
    head = h * GROUP + r % GROUP
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + b * q_b + s[:, None] * q_s + head[:, None] * q_h + d[None, :])
    p_q = tl.load(qpos_ptr + s)

    # Which keys to visit, from the rows' position range. With strictly increasing integer key positions, key j
    # sits at >= k_pos[0] + j and <= k_pos[L-1] - (L-1-j): keys from `hi` on are later than every query here,
    # keys before `lo` older than every row's window; keys in [full_lo, full_hi) are visible to every row. The
    # mask is exact whatever a masked tile holds.
    q_min = tl.min(p_q, axis=0)
    q_max = tl.max(p_q, axis=0)
    k_first = tl.load(kpos_ptr)
    k_last = tl.load(kpos_ptr + length - 1)
    hi = tl.minimum(q_max - k_first + 1, length).to(tl.int32)
    full_hi = tl.minimum(tl.maximum(q_min - k_last + length, 0), length).to(tl.int32)
    if WINDOW:
        lo = tl.maximum(q_min - window - k_last + length, 0).to(tl.int32)
        full_lo = tl.maximum(q_max - window - k_first + 1, 0).to(tl.int32)
        t_lo = lo // BLOCK_N
        t_a = tl.cdiv(full_lo, BLOCK_N)
    else:
        t_lo = tl.full([], 0, tl.int32)
        t_a = t_lo
    # Key tiles [t_lo, t_hi): masked up to t_a, whole in [t_a, t_b), masked from t_b.
    t_hi = tl.cdiv(hi, BLOCK_N)
    t_a = tl.minimum(tl.maximum(t_a, t_lo), t_hi)
    t_b = tl.minimum(tl.maximum(full_hi // BLOCK_N, t_a), t_hi)

    k_base = k_ptr + b * k_b + h * k_h
    v_base = v_ptr + b * v_b + h * v_h
    p_q = p_q.to(tl.int32)   # positions fit in 32 bits: the mask's compares at half the cost
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running row maxima, in log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)
    acc, l_i, m_i = _key_tiles(q, p_q, acc, l_i, m_i, k_base, v_base, kpos_ptr, t_lo, t_a, length, window, qk_scale,
                               k_l, v_l, d, BLOCK_N, WINDOW, True)
    acc, l_i, m_i = _key_tiles(q, p_q, acc, l_i, m_i, k_base, v_base, kpos_ptr, t_a, t_b, length, window, qk_scale,
                               k_l, v_l, d, BLOCK_N, WINDOW, False)
    acc, l_i, m_i = _key_tiles(q, p_q, acc, l_i, m_i, k_base, v_base, kpos_ptr, t_b, t_hi, length, window, qk_scale,
                               k_l, v_l, d, BLOCK_N, WINDOW, True)
    if SINKS:
        # The head's sink logit joins the normaliser only (gpt-oss); log2 units like the scores.
        sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - top)
        l_i = l_i * alpha + tl.exp2(sink - top)
        acc = acc * alpha[:, None]
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * o_b + s[:, None] * o_s + head[:, None] * o_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=real[:, None])
