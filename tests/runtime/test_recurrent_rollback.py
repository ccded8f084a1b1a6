"""The rollback of the recurrent mixers' states (runtime/ops/recurrent.py) at the op level, fp32: after a kept block of
`n` tokens, `roll_back(index)` (one index for all rows, or one per row) gives the state of a plain forward over the
first `index + 1` tokens of the block, and decoding on from it gives that forward's next outputs; a forward of another
length keeps nothing, so a second roll back returns to the same state; a block shorter than 2 is refused.

Oracle: the same mixer's cached forward over exactly the accepted tokens (fresh random weights and inputs).
Tolerance: 1e-5 absolute (fp32, the same arithmetic in the same order but for the recording).
"""
from __future__ import annotations

import pytest
import torch

from runtime.ops import GatedDeltaNet, Mamba2Mixer
from runtime.ops.recurrent import keep_states, roll_back

B, PREFIX, BLOCK = 2, 6, 4


def _mixer(kind: str):
    torch.manual_seed(0 if kind == "deltanet" else 1)
    if kind == "deltanet":
        mixer = GatedDeltaNet(hidden_size=32, num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=6, conv_kernel=4,
                              rms_norm_eps=1e-6, dtype=torch.float32)
    else:
        mixer = Mamba2Mixer(hidden_size=32, num_heads=4, head_dim=6, state_size=8, n_groups=2, conv_kernel=4,
                            norm_eps=1e-5, dtype=torch.float32)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.rand_like(mixer.A_log).log())
    return mixer.eval()


def _run(mixer, x, positions, cache):
    return mixer(x, positions, cache=cache) if isinstance(mixer, GatedDeltaNet) else mixer(x, positions, cache)


def _cache(mixer):
    return mixer.new_cache(batch_size=B, max_seq_len=32, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["deltanet", "mamba"])
@pytest.mark.parametrize("index", [[0], [2], [3], [1, 3]])
@torch.no_grad()
def test_rolling_back_a_kept_block_gives_the_state_of_the_accepted_tokens(kind, index):
    mixer = _mixer(kind)
    x = torch.randn(B, PREFIX + BLOCK + 1, 32, generator=torch.Generator().manual_seed(len(index) * 10 + index[-1]))
    cache = _cache(mixer)
    keep_states([[cache]], BLOCK)
    _run(mixer, x[:, :PREFIX], torch.arange(PREFIX), cache)                      # another length: keeps nothing
    _run(mixer, x[:, PREFIX:PREFIX + BLOCK], torch.arange(PREFIX, PREFIX + BLOCK), cache)
    roll_back([[cache]], torch.tensor(index))
    for row in range(B):
        accepted = index[row % len(index)] + 1
        plain = _cache(mixer)
        _run(mixer, x[row:row + 1].expand(B, -1, -1)[:, :PREFIX + accepted], torch.arange(PREFIX + accepted), plain)
        torch.testing.assert_close(cache.memory[row], plain.memory[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.conv[row], plain.conv[0], atol=1e-6, rtol=0)
    if len(index) == 1:   # decoding on from the rolled-back state: the next token after the accepted ones
        accepted = index[0] + 1
        nxt = x[:, PREFIX + accepted:PREFIX + accepted + 1]
        full = _run(mixer, torch.cat((x[:, :PREFIX + accepted], nxt), 1), torch.arange(PREFIX + accepted + 1), None)
        step = _run(mixer, nxt, torch.tensor([PREFIX + accepted]), cache)
        torch.testing.assert_close(step, full[:, -1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["deltanet", "mamba"])
@torch.no_grad()
def test_one_token_steps_keep_nothing_so_a_second_roll_back_returns_to_the_same_state(kind):
    mixer = _mixer(kind)
    x = torch.randn(B, PREFIX + BLOCK + 3, 32, generator=torch.Generator().manual_seed(5))
    cache = _cache(mixer)
    keep_states([cache], BLOCK)
    _run(mixer, x[:, :PREFIX], torch.arange(PREFIX), cache)
    _run(mixer, x[:, PREFIX:PREFIX + BLOCK], torch.arange(PREFIX, PREFIX + BLOCK), cache)
    index = torch.tensor([1])
    roll_back([cache], index)
    memory, conv = cache.memory.clone(), cache.conv.clone()
    for t in range(3):
        _run(mixer, x[:, PREFIX + 2 + t:PREFIX + 3 + t], torch.tensor([PREFIX + 2 + t]), cache)
    assert not torch.equal(cache.memory, memory)
    roll_back([cache], index)
    assert torch.equal(cache.memory, memory) and torch.equal(cache.conv, conv)


def test_a_cache_without_kept_states_is_left_alone_and_a_short_block_is_refused():
    mixer = _mixer("mamba")
    cache = _cache(mixer)
    cache.memory.normal_()
    before = cache.memory.clone()
    roll_back([cache], torch.tensor([0]))   # never asked to keep states: nothing to return to
    assert torch.equal(cache.memory, before)
    with pytest.raises(ValueError) as err:
        keep_states([cache], 1)
    assert str(err.value) == "a recurrent cache keeps the states of blocks of at least 2 tokens, got 1"
