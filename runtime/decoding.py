"""Decoding for every generated build: the causal-LM base class, static-cache decoders replayed as CUDA graphs, and `generate`.

A build's model class extends `CausalLM` (through `runtime.causal_lm.CausalLMBuild`, which constructs
it), which runs the backbone (`self.model`: `embed_tokens`, `layers`, `norm`, `rotary_emb`) and
`self.lm_head`, so the specialized builds and the generic build decode through this one module. A `Decoder` owns static caches for one (batch, length) bucket; on CUDA its one-token step
is captured once as a CUDA graph (the step reads its token ids and position from fixed input tensors and
advances the position on the device) and replayed; on the CPU the same step runs eagerly. `generate`
prefills eagerly, then replays the step, sampling on the device (greedy, or temperature with top-p by
the exponential-race trick, which needs no host sync); with an `eos_token_id` it reads one flag back
every `EOS_CHECK_EVERY` tokens to stop early.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from runtime import parallel
from runtime.graphs import advanced_in_place, capture

# Buckets: a decoder (and its graph) is made per batch rounded up to a power of two and per length
# rounded up to a multiple of LENGTH_BUCKET, so nearby requests reuse one capture.
LENGTH_BUCKET = 256
EOS_CHECK_EVERY = 16


def owner(ref: weakref.ref, what: str):
    """The model a decoder belongs to, from the weak reference the decoder keeps (the model owns its decoders:
    a strong reference back would make a cycle, and a model its caller drops, weights, caches and graph memory
    included, would wait for the cyclic collector). Refused once that model is freed: a captured graph would
    read memory the model no longer holds."""
    model = ref()
    if model is None:
        raise RuntimeError(f"the model of this {what} was freed: keep a reference to the model while you use its "
                           "decoders")
    return model


def batch_bucket(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


def length_bucket(length: int) -> int:
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


class Decoder:
    """Static caches for `batch_size` rows and `max_seq_len` positions, a prefill, and a replayable step."""

    def __init__(self, model: "CausalLM", batch_size: int, max_seq_len: int) -> None:
        self._model = weakref.ref(model)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        device = model.device
        self.caches = model.new_caches(batch_size, max_seq_len)
        self.ids = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @property
    def model(self) -> "CausalLM":
        return owner(self._model, "decoder")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run `[batch_size, S]` prompts from position 0 into the caches; the last position's logits `[B, V]`."""
        seq = input_ids.shape[1]
        if input_ids.shape[0] != self.batch_size or seq >= self.max_seq_len:
            raise ValueError(f"this decoder takes {self.batch_size} rows of fewer than {self.max_seq_len} tokens, "
                             f"got {list(input_ids.shape)}")
        positions = torch.arange(seq, device=input_ids.device)
        # The head over the last position only: over all of a 2048-token prompt it is 1.3 TFLOP and a 0.6 GB
        # logits tensor at a 152k vocabulary, for rows nobody reads.
        hidden = self.model.hidden_states(input_ids, positions, self.caches)
        logits = self.model.lm_head(hidden[:, -1:])[:, 0]
        self.position.fill_(seq)
        return logits

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """One token per row at the current position; returns logits `[B, V]` and advances the position.

        On CUDA the returned tensor is the graph's output buffer: read it before the next step.
        """
        owner(self._model, "decoder")   # the step, and its graph, read the model's weights
        self.ids.copy_(ids.view(self.batch_size, 1))
        if self.ids.device.type != "cuda":
            return self._step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _step(self) -> torch.Tensor:
        # The bucket's rows fix the MoE exchange of data-parallel layouts (runtime.ops.moe): fixed shapes,
        # no host sync, so the step captures.
        with parallel.token_capacity(self.batch_size):
            logits = self.model(self.ids, self.position, self.caches)[:, -1]
        self.position.add_(1)
        return logits

    def _capture(self) -> None:
        self.graph, self.logits = capture(self._step, state=(self.position, *advanced_in_place(self.caches)))


@dataclass
class Generation:
    """`tokens [B, S + n]` (prompt then generated ids, on the CPU), and the time prefill and decode took."""

    tokens: torch.Tensor
    prompt_len: int
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: generated tokens after the first (which prefill yields) over decode time."""
        return self.tokens.shape[0] * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next ids `[B]` from logits `[B, V]`: argmax when `temperature == 0`, else a draw from the top-p nucleus."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely id always stays).
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i / sum(p).
    race = torch.empty_like(probs).exponential_(generator=generator)
    return order.gather(-1, (probs / race).argmax(dim=-1, keepdim=True)).squeeze(-1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CausalLM(nn.Module):
    """The forward, caches and decoding every generated model class shares.

    Subclasses set `self.model` (the checkpoint's `model.*`), `self.lm_head`, `self.dtype` and `self.device`.
    `positions [S]` are the tokens' positions, increasing (default `arange(S)`), the same for every row.
    """

    def new_caches(self, batch_size, max_seq_len):
        # A layer whose token mixer is not `self_attn` (a recurrent linear attention, a Mamba mixer) makes its own cache.
        makers = [layer.new_cache if hasattr(layer, "new_cache") else layer.self_attn.new_cache for layer in self.model.layers]
        return [make(batch_size=batch_size, max_seq_len=max_seq_len, dtype=self.dtype, device=self.device) for make in makers]

    def hidden_states(self, input_ids, positions=None, caches=None, aux_layers=()):
        """The final-norm hidden states `[B, S, H]` (what a draft reads); with `aux_layers`, also the outputs
        of those layers concatenated, `[B, S, len(aux_layers) * H]` (what an Eagle3 draft reads)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        aux = []
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, positions, cos, sin, None if caches is None else caches[i])
            if i in aux_layers:
                aux.append(hidden)
        if aux_layers:
            return self.model.norm(hidden), torch.cat(aux, dim=-1)
        return self.model.norm(hidden)

    def forward(self, input_ids, positions=None, caches=None):
        return self.lm_head(self.hidden_states(input_ids, positions, caches))

    def decoder(self, batch_size: int, max_seq_len: int) -> Decoder:
        """The decoder of the bucket that holds `batch_size` rows of `max_seq_len` positions (made once)."""
        key = (batch_bucket(batch_size), length_bucket(max_seq_len))
        layout = getattr(self, "layout", None)
        if layout is not None and layout.dp > 1:
            # Every replica's step exchanges blocks of its bucket's rows: all must choose the same bucket.
            parallel.check_same_tokens(key[0], type(self).__name__, self.device)
        decoders = self.__dict__.setdefault("_decoders", {})
        if key not in decoders:
            decoders[key] = Decoder(self, *key)
        return decoders[key]

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        seed: int = 0,
        speculative=None,
    ) -> Generation:
        """Continue `input_ids [B, S]` by up to `max_new_tokens` ids: greedy when `temperature == 0`, else
        sampled (temperature, top-p). Rows that reach `eos_token_id` continue with it; all rows finished
        stops early (single-rank builds only: ranks of a layout must run the same steps). `speculative`
        (draft tokens k, or a `runtime.speculative.Speculation`): decode with a draft (runtime.speculative)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature} and {top_p}")
        if speculative is not None:
            from runtime import speculative as spec

            return spec.generate(self, input_ids, max_new_tokens, speculative, temperature=temperature,
                                 top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        batch, seq = input_ids.shape
        decoder = self.decoder(batch, seq + max_new_tokens)
        device = decoder.ids.device
        ids = input_ids.to(device)
        if decoder.batch_size > batch:  # pad to the bucket with copies of the last row, dropped at the end
            ids = torch.cat((ids, ids[-1:].expand(decoder.batch_size - batch, seq)))
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=device).manual_seed(seed)
        layout = getattr(self, "layout", None)
        stop_early = eos_token_id is not None and (layout is None or layout.world == 1)

        sync(device)
        start = time.perf_counter()
        token = sample(decoder.prefill(ids), temperature, top_p, generator)
        sync(device)
        prefilled = time.perf_counter()
        finished = torch.zeros(decoder.batch_size, dtype=torch.bool, device=device)
        out, steps = [token], 0
        while len(out) < max_new_tokens:
            if eos_token_id is not None:
                finished |= token == eos_token_id
                if stop_early and len(out) % EOS_CHECK_EVERY == 0 and bool(finished[:batch].all()):
                    break
            token = sample(decoder.step(token), temperature, top_p, generator)
            steps += 1
            if eos_token_id is not None:
                token = torch.where(finished, eos_token_id, token)
            out.append(token)
        sync(device)
        done = time.perf_counter()
        tokens = torch.cat((input_ids.cpu(), torch.stack(out, dim=1)[:batch].cpu()), dim=1)
        return Generation(tokens, seq, prefilled - start, done - prefilled, steps)
