"""The attention mask from positions as a Triton helper, shared by the decode and prompt kernels (the rule of
`runtime.ops.attention_core.allowed_keys`: key <= query, and key > query - window on sliding layers)."""
import triton
import triton.language as tl


@triton.jit
def visible(p_q, p_k, in_range, window, WINDOW: tl.constexpr):
    """Which keys each query sees: `p_q` and `p_k` broadcast against each other, `in_range` masks padding."""
    allowed = in_range & (p_k <= p_q)
    if WINDOW:
        allowed = allowed & (p_k > p_q - window)
    return allowed
