"""HFEngine: sampling with transformers' ``generate`` (batched, left-padded, KV cache; no per-token Python loop of ours).

The ``n`` samples of a prompt share its prefill: each distinct prompt runs through the model once (all but its
last token), the KV cache is gathered to its rows, and ``generate`` continues from it (:func:`shared_prefill`).
With GRPO's ``n = 8`` the prompt tokens cost an eighth of what ``generate`` alone spends on them; the samples are
the same (same logits up to float rounding, same random draws).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from transformers import (
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlflow.models.shared_prompt import cache_argument, can_share, distinct_prompts, prompt_cache
from rlflow.models.vision import concat_inputs, generation_inputs
from rlflow.rollout.engines.base import Completion, Engine, MultiModalPrompt, SamplingParams, WeightBuckets, counted
from rlflow.rollout.engines.routing import RoutingRecorder


class _RecordLogProbs(LogitsProcessor):
    """Keeps the temperature-scaled log-softmax of the current step so the chosen token's log-prob can be read.

    Only one ``B x V`` step is held at a time: at step t it reads the log-prob of the
    token chosen at step t-1 (now the last of ``input_ids``) from the stored step.
    """

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.previous: Tensor | None = None
        self.chosen: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        self.take(input_ids)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def take(self, input_ids: Tensor) -> None:
        if self.previous is not None and input_ids.shape[1] > self.prompt_len + len(self.chosen):
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))


def processors(params: SamplingParams, prompt_len: int) -> tuple[LogitsProcessorList, _RecordLogProbs]:
    """Temperature, then the log-prob recorder, then top-k/top-p: log-probs are read before truncation."""
    recorder = _RecordLogProbs(prompt_len)
    procs = []
    if not params.greedy and params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    procs.append(recorder)
    if not params.greedy and params.top_k > 0:
        procs.append(TopKLogitsWarper(params.top_k))
    if not params.greedy and params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    return LogitsProcessorList(procs), recorder


def left_padded(prompts: list[list[int]], n: int, pad: int, device) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` of shape ``[len(prompts) * n, P]``: each prompt ``n`` times in a row, padded on the left."""
    P = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows], dtype=torch.long, device=device)
    return ids, mask


def response_mask_until_eos(response: Tensor, eos_token_id: int | list[int] | None) -> Tensor:
    """1 on tokens up to and including the first EOS, 0 after it (``B x R`` int64)."""
    if eos_token_id is None:
        return torch.ones_like(response)
    eos_ids = torch.as_tensor(eos_token_id, device=response.device).reshape(-1)
    is_eos = torch.isin(response, eos_ids).long()
    # tokens strictly after the first EOS have a positive count of EOS before them
    after = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after).long()


def shared_prefill(model: nn.Module, ids: Tensor, mask: Tensor) -> DynamicCache | None:
    """The KV cache of ``ids[:, :-1]`` with each distinct prompt run once (``rlflow.models.shared_prompt``),
    gathered to every row; ``generate`` given it feeds only the last prompt column. ``None`` (plain ``generate``)
    when no prompt repeats, there is one prompt column, or the model cannot share (``can_share``)."""
    shared = distinct_prompts(ids, mask) if ids.shape[1] > 1 and can_share(model) else None
    if shared is None:
        return None
    cache, _ = prompt_cache(model.get_decoder(), model.config, ids[:, :-1], mask[:, :-1], *shared)
    return cache


class HFEngine(Engine):
    """Generates with a transformers causal LM's ``generate``.

    When the model is the trained module itself (one device, DDP) nothing needs to move after an update;
    when it is a copy (the Trainer makes one under FSDP2, whose sharded forward is collective),
    :meth:`load_weights` copies buckets into it.

    Image-text-to-text models take images: each prompt's processor tensors are concatenated in row order
    (``rlflow.models.vision``) and ``generate`` derives the 3-D rotary positions from them.

    ``SamplingParams(return_routed_experts=True)`` records the experts every MoE layer routes each token to
    (:class:`~rlflow.rollout.engines.routing.RoutingRecorder`; the prompt's prefill is then not shared).
    """

    accepts_images = True
    supports_ignore_eos = True
    returns_routed_experts = True

    def __init__(self, model: nn.Module | None = None, tokenizer=None, *, cache_implementation: str | None = None,
                 compile: bool = False):
        """Args:
            model, tokenizer: the causal LM to sample with and its tokenizer; or neither, and :meth:`bind` them later
                (a rollout's ``bind`` does).
            cache_implementation: transformers' KV cache kind (``None``: its dynamic cache; ``"static"``: one
                preallocated cache per call, what compiled decoding needs).
            compile: let ``generate`` compile the decoding step (``torch.compile``, CUDA graphs on GPU; a
                static cache is implied). Off by default: compiling costs minutes up front and gains on GPUs.
        """
        self.model, self.tokenizer = model, tokenizer
        self.cache_implementation = cache_implementation or ("static" if compile else None)
        self.compile = compile

    def bind(self, model: nn.Module, tokenizer) -> None:
        """Generate with ``model`` (the trained module itself, or a full copy of it) from now on."""
        self.model, self.tokenizer = model, tokenizer

    @property
    def module(self) -> nn.Module | None:
        return self.model

    def device(self) -> torch.device:
        if self.model is None:
            raise RuntimeError("HFEngine has no model: build it with one, or call engine.bind(model, tokenizer) "
                               "(a rollout's bind does)")
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def stops(self, params: SamplingParams) -> list[int]:
        """The tokens that end a completion: EOS (unless ``params.ignore_eos``) and ``params.stop_token_ids``."""
        eos = [] if params.ignore_eos else self.eos_token_ids
        return eos + [t for t in params.stop_token_ids if t not in eos]

    @torch.no_grad()
    def generate_padded(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                        vision_inputs: dict[str, Tensor] | None = None,
                        routing: RoutingRecorder | None = None) -> tuple[Tensor, Tensor]:
        """The tensor form: left-padded ``[N, P]`` prompts (one row per sample) -> ``(sequences[:, P:], log_probs)``,
        both ``[N, R]``; rows that stopped early are padded (ids with the pad id, log-probs with 0 from ``R``).

        ``vision_inputs``: the rows' processor tensors, concatenated in row order (``rlflow.models.vision``).
        Rows with the same prompt (a prompt's samples) share its prefill (:func:`shared_prefill`; not with
        images, a static cache, compiled decoding or a ``routing`` recorder, which records every row's routing)."""
        if routing is not None and self.compile:
            raise ValueError("HFEngine(compile=True) cannot record the routed experts (return_routed_experts): the "
                             "compiled decoding step runs no hooks")
        stops = self.stops(params)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=not params.greedy,
            temperature=None, top_k=None, top_p=None,  # ours, in processors()
            # None falls back to the model's generation config (its EOS); [] stops on nothing (ignore_eos)
            eos_token_id=stops if params.ignore_eos else (stops or None), pad_token_id=self.tokenizer.pad_token_id, use_cache=True,
            cache_implementation=self.cache_implementation,
            compile_config=CompileConfig(fullgraph=False) if self.compile else None, disable_compile=not self.compile,
        )
        P = prompt_ids.shape[1]
        procs, recorder = processors(params, P)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[prompt_ids.device] if prompt_ids.is_cuda else [],
                                       enabled=params.seed is not None):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                if vision_inputs:
                    extra = generation_inputs(self.model, prompt_ids, vision_inputs)
                else:
                    static = self.cache_implementation is not None  # a preallocated cache of transformers' own
                    shared = not static and routing is None
                    cache = shared_prefill(self.model, prompt_ids, prompt_mask) if shared else None
                    extra = {cache_argument(self.model): cache} if cache is not None else {}
                with routing if routing is not None else nullcontext():
                    sequences = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                                    generation_config=config, logits_processor=procs, **extra)
        finally:
            self.model.train(was_training)
        recorder.take(sequences)
        response = sequences[:, P:]
        R = response.shape[1]
        log_probs = torch.stack(recorder.chosen[:R], dim=1) if R else response.float()
        return response, log_probs

    def generate_tensors(self, prompt_ids: Tensor, prompt_mask: Tensor,
                         params: SamplingParams) -> tuple[Tensor, ...] | None:
        """:meth:`generate` without the trip through Python lists (see ``Engine.generate_tensors``): the same
        call to ``generate`` on the same left-padded rows, so the same samples. ``None`` when the prompts are
        not plainly left-padded or a subclass changed :meth:`generate` (its list form is then the truth).
        With ``params.return_routed_experts`` two more: the routing of the prompt and of the response tokens
        (``[N, P, L, k]`` aligned with ``prompt_ids``, ``[N, R, L, k]``; -1 on padding)."""
        if type(self).generate is not HFEngine.generate:
            return None
        real = prompt_mask.bool()
        lengths = real.sum(-1)
        P = int(lengths.max()) if lengths.numel() else 0
        ids, real = prompt_ids[:, prompt_ids.shape[1] - P:], real[:, real.shape[1] - P:]
        # left padding: no real token before a padding one, none lost by dropping the all-padding columns
        if P == 0 or bool((real[:, 1:] < real[:, :-1]).any() | (real.sum(-1) != lengths).any()):
            return None
        device = self.device()
        pad = self.tokenizer.pad_token_id
        ids = ids.masked_fill(~real, pad).repeat_interleave(params.n, 0).to(device)  # as ``left_padded`` builds them
        rows_real = real.repeat_interleave(params.n, 0).to(device)
        recorder = RoutingRecorder(self.model, ids.shape[0]) if params.return_routed_experts else None
        response, log_probs = self.generate_padded(ids, rows_real.long(), params, routing=recorder)
        stops = self.stops(params)
        mask = response_mask_until_eos(response, stops or None)
        R = int(mask.sum(-1).max())  # rows that stopped are padded by generate; the longest completion sets R
        mask, valid = mask[:, :R], mask[:, :R].bool()
        out = response[:, :R].masked_fill(~valid, pad), mask, log_probs[:, :R].masked_fill(~valid, 0.0)
        if recorder is None:
            return out
        routing = recorder.routing(P + R)
        prompt = routing.new_full((ids.shape[0], prompt_ids.shape[1], *routing.shape[2:]), -1)
        prompt[:, prompt_ids.shape[1] - P :] = routing[:, :P].masked_fill(~rows_real[..., None, None], -1)
        return *out, prompt, routing[:, P:].masked_fill(~valid[..., None, None], -1)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 multi_modal: list[MultiModalPrompt | None] | None = None) -> list[list[Completion]]:
        device = self.device()
        ids, mask = left_padded(prompts, params.n, self.tokenizer.pad_token_id, device)
        vision = None
        if multi_modal is not None:  # each prompt's images once per sample, in row order
            vision = concat_inputs([(m.inputs if m else {}) for m in multi_modal for _ in range(params.n)], device)
        recorder = RoutingRecorder(self.model, ids.shape[0]) if params.return_routed_experts else None
        response, log_probs = self.generate_padded(ids, mask, params, vision, routing=recorder)
        routing = recorder.routing(ids.shape[1] + response.shape[1]) if recorder is not None else None
        stops = set(self.stops(params))
        out: list[list[Completion]] = []
        for row, (tokens, lps) in enumerate(zip(response.tolist(), log_probs.tolist())):
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
            done = end is not None
            end = end if done else len(tokens)
            if row % params.n == 0:
                out.append([])
            extras = {}
            if routing is not None:  # the real prompt tokens', then the completion's
                seen = torch.cat([mask[row].bool(), torch.arange(response.shape[1], device=device) < end])
                extras["routed_experts"] = routing[row][seen].cpu()
            out[-1].append(Completion(tokens[:end], lps[:end], "stop" if done else "length", extras))
        return out

    @torch.no_grad()
    def load_weights(self, buckets: WeightBuckets) -> dict[str, float]:
        """Copy each bucket into the model's parameters (tied ones may arrive under each of their names)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        totals, start = {"weight_sync/buckets": 0.0, "weight_sync/gb": 0.0}, time.perf_counter()
        for name, tensor in counted(buckets, totals):
            if name not in params:
                raise KeyError(f"weight sync: the engine's model has no parameter '{name}'")
            params[name].copy_(tensor)
        return totals | {"weight_sync/load_s": time.perf_counter() - start}
