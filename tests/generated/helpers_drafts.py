"""Shared by the draft-build tests: a model's draft-holding target, its target and draft loaded from one
checkpoint folder, the speculative run whose greedy tokens must be the target's own (RULES SD1), and the folder
of tiny_kimi_k3's external drafter."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from tests.generated import builds


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out (the MTP formulas' oracle): x / sqrt(mean(x^2) + eps) * weight, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


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

    with builds.vanilla_experts(build_modules(model, mode)):
        yield load_model(model, 90, checkpoint=str(folder), checkpoint_name=checkpoint_name,
                         speculative_config={"mode": mode}, dtype=torch.float32, mode="require").eval()


def assert_speculative_greedy_is_the_target_greedy(target, k: int, new_tokens: int):
    """Greedy speculative decoding with k draft tokens a round emits the target's own greedy tokens (SD1): exactly
    where the target's arithmetic is fp32, up to ties within 5e-3 of the largest logit where its experts take bf16
    operands (such a run keeps ties within bf16's eps at many positions; tiny_deepseek_v4_flash's draft-stage
    target diverged in 8 of 1300 rows, at gaps of 5e-5 to 1.25e-3); returns the run's Generation."""
    from runtime import speculative

    run = lambda prompt: target.generate(prompt, new_tokens, speculative=k)  # noqa: E731
    if speculative.tie_eps(target) == torch.finfo(torch.float32).eps:
        prompt, out = builds.tie_free_run(target, run, batch=2, length=5)
        assert torch.equal(out.tokens, builds.greedy_reference(target, prompt, new_tokens))
    else:
        prompt = builds.token_ids(speculative.vocab_size(target), batch=2, length=5)
        out = run(prompt)
        builds.assert_greedy_equal_up_to_ties(target, out.tokens, builds.greedy_reference(target, prompt, new_tokens),
                                              tol=5e-3)
    assert out.note is None and out.proposed == k * out.rounds
    # the prefill's token, then a + 1 a round; the last round may pass new_tokens by up to k
    assert 1 + out.rounds + out.accepted >= new_tokens > out.rounds + out.accepted - k
    return out


def held_bytes(target, draft) -> int:
    """The bytes of every distinct storage target and draft compute with: their parameters and buffers, and the
    embedding and head the draft's forward calls (outside its module tree when it shares the target's)."""
    tensors = [*target.parameters(), *target.buffers(), *draft.parameters(), *draft.buffers(),
               draft.embed_tokens.weight, draft.lm_head.weight]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def assert_the_mtp_draft_shares_the_target_embedding_and_head(model: str, folder, checkpoint_name: str, embedding: str) -> None:
    """load_model's MTP draft embeds and scores with the target's own tensors (one storage each), computes the
    logits of a draft loaded on its own from the same folder, and target + draft hold exactly the embedding's and
    head's bytes less; a draft sharing them reads only its own `mtp.*` tensors from the folder."""
    from generated import load_model

    target = load_model(model, 90, checkpoint=str(folder), checkpoint_name=checkpoint_name,
                        speculative_config={"mode": "mtp"}, dtype=torch.float32, mode="require").eval()
    draft = target.draft
    alone_target, alone_draft, _ = target_and_draft(model, folder)
    for name, mine, theirs in (("embed", draft.embed_tokens, target.model.embed_tokens), ("head", draft.lm_head, target.lm_head)):
        assert mine is theirs, name
        assert mine.weight.untyped_storage().data_ptr() == theirs.weight.untyped_storage().data_ptr()
    # The separately loaded draft holds copies of its own (the standalone path keeps working).
    assert alone_draft.embed_tokens.weight.data_ptr() != alone_target.model.embed_tokens.weight.data_ptr()
    ids, next_ids = builds.token_ids(512, 2, 9), builds.token_ids(512, 2, 9)
    with torch.no_grad():
        hidden = target.hidden_states(ids)
        shared, alone = draft(next_ids, hidden), alone_draft(next_ids, hidden)
    assert torch.equal(shared[0], alone[0]) and torch.equal(shared[1], alone[1])
    copies = alone_draft.embed_tokens.weight.nbytes + alone_draft.lm_head.weight.nbytes
    assert held_bytes(alone_target, alone_draft) - held_bytes(target, draft) == copies
    # Not read twice: a sharing draft's load reads the `mtp.*` tensors only and leaves the target's as they were.
    tensors = builds.read_tensors(folder)
    fresh = build_modules(model)[1].DRAFT_CLASS(dtype=torch.float32)
    before = alone_target.lm_head.weight.clone()
    assert fresh.share_with(alone_target)
    report = fresh.load_checkpoint(folder)
    mtp = {name for name in tensors if name.startswith("mtp.")}
    assert report.tensors == len(mtp) and set(report.ignored) == set(tensors) - mtp
    assert {embedding, "lm_head.weight"} <= set(report.ignored)
    assert torch.equal(alone_target.lm_head.weight, before) and fresh.lm_head is alone_target.lm_head


def assert_a_draft_of_another_dtype_keeps_its_copies(model: str, folder, caplog, embedding: str) -> None:
    """Where the target's tensors cannot serve the draft (here its dtype), the draft keeps its copies, says why, and
    still loads them from the folder."""
    import logging

    target, _, _ = target_and_draft(model, folder)
    draft = build_modules(model)[1].DRAFT_CLASS(dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="moegen"):
        assert not draft.share_with(target)
    name = embedding.removesuffix(".weight")
    assert ("the MTP draft keeps its own copies of the embedding and lm_head: the target's "
            f"{name} has dtype torch.float32, the draft's torch.bfloat16") in caplog.messages
    assert draft.embed_tokens is not target.model.embed_tokens and draft.lm_head is not target.lm_head
    draft.load_checkpoint(folder)
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight.bfloat16())


# tiny_kimi_k3's external drafter (a Qwen3-MoE model over the target's vocabulary), and the one-rank target whose
# draft.py builds it: the names and whole shapes of the tensors its folder holds.
EXTERNAL_MODEL, EXTERNAL_DRAFTER = "tiny_kimi_k3", "tiny_kimi_k3_drafter"
EXTERNAL_TARGET = "tiny_kimi_k3_mxfp4__sm_90__tp1"


def drafter_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    """Every tensor of the external drafter's checkpoint, seeded random (its one-rank build's names and shapes)."""
    from families import FAMILIES
    from runtime.checkpoint.writer import random_tensors

    module = builds.load(f"generated.{EXTERNAL_MODEL}.{EXTERNAL_TARGET}.draft")
    return random_tensors(module.DRAFT_CLASS(device="meta"), FAMILIES[module.FAMILY].experts_storage, seed)


def drafter_folder(folder, tensors: dict[str, torch.Tensor] | None = None, **overrides) -> Path:
    """A folder of the external drafter: `tensors` (default: `drafter_tensors()`) beside its declared config (with
    `overrides`) as config.json."""
    from runtime.checkpoint.writer import save_checkpoint

    config = builds.facts(EXTERNAL_MODEL).DRAFT_CONFIGS[EXTERNAL_DRAFTER] | overrides
    return save_checkpoint(drafter_tensors() if tensors is None else tensors, folder, config)
