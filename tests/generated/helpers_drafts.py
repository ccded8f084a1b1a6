"""Shared by the draft-build tests: a model's draft-holding target, its target and draft loaded from one
checkpoint folder, and the speculative run whose greedy tokens must be the target's own (RULES SD1)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.generated import builds


def draft_target(model: str, mode: str = "mtp") -> dict:
    """The model's specialized target whose draft serves speculative mode `mode`."""
    return next(t for t in builds.specialized(model) if t["spec_mode"] == mode)


def build_modules(model: str, mode: str = "mtp"):
    """(modeling module, draft module) of that target."""
    module = "generated" + draft_target(model, mode)["module"]
    return builds.load(module), builds.load(module.replace(".modeling", ".draft"))


def target_and_draft(model: str, folder, mode: str = "mtp"):
    """(target, draft, (target report, draft report)): both built in fp32 and loaded from `folder`."""
    modeling, draft_module = build_modules(model, mode)
    target = modeling.MODEL_CLASS(dtype=torch.float32)
    draft = draft_module.DRAFT_CLASS(dtype=torch.float32)
    reports = target.load_checkpoint(folder), draft.load_checkpoint(folder)
    return target.eval(), draft.eval(), reports


@contextlib.contextmanager
def vanilla_speculative_target(model: str, folder, checkpoint_name: str, mode: str = "mtp"):
    """load_model's target with its draft attached, both bound to VANILLA experts (fp32 GEMMs: SD1 is exact only
    where the arithmetic is, as test_speculative's)."""
    from generated import load_model
    from runtime.experts.vanilla import TorchEagerBf16Experts

    with pytest.MonkeyPatch.context() as patch:
        for module in build_modules(model, mode):
            patch.setattr(module, "IMPLEMENTATIONS", {i: (TorchEagerBf16Experts, "VANILLA") for i in module.IMPLEMENTATIONS})
            patch.setattr(module, "CPU_IMPLS", tuple(module.IMPLEMENTATIONS))
        yield load_model(model, 90, checkpoint=str(folder), checkpoint_name=checkpoint_name,
                         speculative_config={"mode": mode}, dtype=torch.float32, mode="require").eval()


def assert_speculative_greedy_is_the_target_greedy(target, k: int, new_tokens: int):
    """Greedy speculative decoding with k draft tokens a round emits exactly the target's own greedy tokens;
    returns the run's Generation."""
    from runtime import speculative

    prompt = builds.token_ids(speculative.vocab_size(target), batch=2, length=5)
    out = target.generate(prompt, new_tokens, speculative=k)
    assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, new_tokens))
    assert out.note is None and out.proposed == k * out.rounds
    # the prefill's token, then a + 1 a round; the last round may pass new_tokens by up to k
    assert 1 + out.rounds + out.accepted >= new_tokens > out.rounds + out.accepted - k
    return out
