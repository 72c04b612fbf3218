"""SingleTurnRollout: prompts in a TensorDict -> ``n`` sampled responses each, with any engine.

It does what every single-turn rollout does whatever samples the tokens: strip the prompts' left padding,
ask the engine for ``n`` completions per prompt, and lay them out as right-padded tensors with their mask,
the sampler's log-probs, group ids and decoded text. ``HFRollout``, ``VLLMRollout`` and ``ServerRollout``
are this class with an engine chosen for them.
"""

from __future__ import annotations

import copy
import time

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row, repeat_interleave, shallow_copy, stack
from rlflow.module import BatchModule
from rlflow.rollout.engines.base import Completion, Engine, MultiModalPrompt, SamplingParams
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES, update_buckets

SAMPLING_OPTIONS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "do_sample", "seed", "stop_token_ids")


class SingleTurnRollout(BatchModule):
    """Turns prompts into ``n`` samples each with an :class:`~rlflow.rollout.engines.base.Engine`.

    Reads left-padded prompts; writes right-padded responses, a response mask that covers each completion
    (up to and including its stop/EOS token), the sampler's log-probs (temperature-scaled, before top-k/top-p
    truncation, as the policy computes them), a ``group`` id per prompt and the decoded text. Non-tensor
    prompt fields (ground truth, data source, ...) are repeated with their rows.

    Args:
        engine: the engine to sample with; subclasses make one in :meth:`bind` instead (``None`` here).
        n: samples per prompt.
        temperature, top_p, top_k, max_new_tokens: sampling options (``top_k=-1``, ``top_p=1``: off).
        do_sample: ``False`` for greedy decoding.
        seed: seeds each call's sampling (``None``: the engine's random stream).
        stop_token_ids: tokens that end a response besides the tokenizer's EOS.
        bucket_bytes: the most bytes of weights sent to the engine in one piece (``sync_weights``).

    ``bind(model, tokenizer)`` (the Trainer calls it) points the rollout at the trained model; when the
    engine holds weights of its own, they are loaded from ``model`` then, and again by ``sync_weights``
    after every update, in buckets of at most ``bucket_bytes``.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP, K.RESPONSE_TEXT)
    # whether the engine this class makes in bind() takes images (vision-language prompts); the verl entry
    # point refuses a vision-language model before training with a rollout that does not
    makes_image_engine: bool = False
    ignore_eos: bool = False  # generation goes on past EOS (HFRollout(ignore_eos=True))

    def __init__(self, engine: Engine | None = None, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if do_sample and temperature <= 0:
            raise ValueError("temperature must be > 0 when sampling; use do_sample=False for greedy decoding")
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_new_tokens, self.do_sample, self.seed = max_new_tokens, do_sample, seed
        self.stop_token_ids = tuple(stop_token_ids)
        self.params  # validates the rest now, not at the first rollout
        self.engine = engine
        self.model = None
        self.tokenizer = None
        self.bucket_bytes = bucket_bytes

    @property
    def holds_own_weights(self) -> bool:
        """True when the engine keeps its own copy of the weights: the Trainer then binds the trained model
        itself (no copy, even when it is sharded) and every update is sent with ``sync_weights``."""
        return bool(getattr(self.engine, "holds_own_weights", False))

    @property
    def stats(self) -> dict[str, float]:
        """The engine's metrics of the last call (e.g. a server's ``server/retries``); the Trainer logs them."""
        return dict(getattr(self.engine, "stats", {}))

    @property
    def params(self) -> SamplingParams:
        """This rollout's options as engine-neutral sampling parameters."""
        engine = getattr(self, "engine", None)  # None while __init__ validates
        if self.ignore_eos and engine is not None and not getattr(engine, "supports_ignore_eos", False):
            raise ValueError(f"ignore_eos: {type(engine).__name__} cannot generate past EOS here")
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, greedy=not self.do_sample, seed=self.seed,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)

    # ------------------------------------------------------------------ engine and weights
    def make_engine(self, model, tokenizer) -> Engine:
        """The engine for ``model`` (subclasses); the base class samples with the engine it was given."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} has no engine: pass engine=... or use a rollout that makes "
                               "one (HFRollout, VLLMRollout, ServerRollout)")
        return self.engine

    def bind(self, model, tokenizer) -> None:
        """Sample for ``model`` with ``tokenizer`` from now on (an engine with its own weights loads them now)."""
        self.model, self.tokenizer = model, tokenizer
        self.engine = self.make_engine(model, tokenizer)
        if self.holds_own_weights and getattr(self.engine, "loaded_from", None) is not model:
            self.sync_weights(model)

    def sync_weights(self, trained) -> dict[str, float]:
        """After an update, bring the engine's weights up to date with ``trained``.

        Nothing moves when the engine generates with ``trained`` itself (HF on one device or DDP); otherwise
        its parameters are gathered (from FSDP2 shards too) and loaded bucket by bucket, tied parameters under
        all their names. A LoRA policy sends merged weights (or the adapter to a PEFT copy), all of them the
        first time, then only what updates change (``rlflow.rollout.weight_sync.update_buckets``). Returns
        ``weight_sync/*`` metrics (buckets, GB moved, seconds).
        """
        if self.engine is None or getattr(self.engine, "model", None) is trained:
            return {}
        start = time.perf_counter()
        changed_only = getattr(self.engine, "loaded_from", None) is trained
        buckets = update_buckets(trained, getattr(self.engine, "model", None), self.bucket_bytes, changed_only)
        metrics = self.engine.load_weights(buckets)
        self.engine.loaded_from = trained  # an engine shared by several rollouts knows whose weights it holds
        return metrics | {"weight_sync/seconds": time.perf_counter() - start}

    def with_options(self, **overrides) -> "SingleTurnRollout":
        """A copy with other sampling options (e.g. greedy validation), sharing engine, model and tokenizer."""
        unknown = set(overrides) - set(SAMPLING_OPTIONS)
        if unknown:
            raise TypeError(f"with_options: unknown option(s) {sorted(unknown)}; choose from {SAMPLING_OPTIONS}")
        clone = copy.copy(self)
        for key, value in overrides.items():
            setattr(clone, key, tuple(value) if key == "stop_token_ids" else value)
        if clone.do_sample and clone.temperature <= 0:
            raise ValueError("temperature must be > 0 when sampling; use do_sample=False for greedy decoding")
        clone.params  # validates
        return clone

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]],
                 multi_modal: list[MultiModalPrompt | None] | None = None) -> list[list[Completion]]:
        """The engine's completions for token-id prompts (``n`` each); checks none was lost or duplicated.

        ``multi_modal``: per prompt, its images (vision-language prompts; the engine must accept images).
        """
        if multi_modal is None:
            completions = self.engine.generate(prompts, self.params)
        elif not getattr(self.engine, "accepts_images", False):
            raise TypeError(f"{type(self.engine).__name__} does not take images (accepts_images=False): "
                            "vision-language prompts need an engine that does (HFEngine, i.e. HFRollout)")
        else:
            completions = self.engine.generate(prompts, self.params, multi_modal)
        if len(completions) != len(prompts) or any(len(c) != self.n for c in completions):
            raise RuntimeError(f"{type(self.engine).__name__} returned {[len(c) for c in completions]} completions "
                               f"for {len(prompts)} prompts, expected {self.n} each")
        return completions

    def forward(self, batch: TensorDict) -> TensorDict:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call rollout.bind(model, tokenizer) (the Trainer does)")
        if self.holds_own_weights and self.model is not None and getattr(self.engine, "loaded_from", None) is not self.model:
            self.sync_weights(self.model)  # a shared engine loaded another model's weights since (tests, notebooks)
        ids, mask = batch.get(K.PROMPT_IDS), batch.get(K.PROMPT_MASK)
        images = multi_modal_prompts(batch)
        # engines that sample padded tensors (HF) skip the trip through lists; images take the list form
        tensor_form = getattr(self.engine, "generate_tensors", None) if images is None else None
        sampled = tensor_form(ids, mask, self.params) if tensor_form is not None else None
        if sampled is None:
            return self.samples(batch, self.generate(unpadded(ids, mask), images))
        return self.laid_out(batch, sampled)

    def samples(self, batch: TensorDict, completions: list[list[Completion]]) -> TensorDict:
        """Lay out the engine's completions (``n`` per prompt of ``batch``) as the rollout's batch."""
        flat = [c for per_prompt in completions for c in per_prompt]
        return self.laid_out(batch, padded_completions(flat, self.tokenizer.pad_token_id))

    def laid_out(self, batch: TensorDict, sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> TensorDict:
        """``batch``'s prompt rows repeated ``n`` times with the sampled ``(response_ids, response_mask, log_probs)``,
        group ids and text."""
        num_prompts, ids = batch.batch_size[0], batch.get(K.PROMPT_IDS)
        response, response_mask, log_probs = (t.to(ids.device) for t in sampled)
        # shallow: tensordict's clone(False) rebuilds every non-tensor row; repeat_interleave shares them
        batch = repeat_interleave(batch, self.n) if self.n > 1 else shallow_copy(batch)
        batch[K.RESPONSE_IDS] = response
        batch[K.RESPONSE_MASK] = response_mask
        batch[K.ROLLOUT_LOG_PROBS] = log_probs
        batch[K.GROUP] = torch.arange(num_prompts, device=ids.device).repeat_interleave(self.n)
        batch[K.RESPONSE_TEXT] = stack(self.tokenizer.batch_decode(response.cpu(), skip_special_tokens=True))
        return batch


def padded_completions(completions: list[Completion], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Completions -> right-padded ``(response_ids, response_mask, log_probs)``, ``[len(completions), R]``."""
    R = max(len(c.token_ids) for c in completions)
    response = torch.full((len(completions), R), pad, dtype=torch.long)
    response_mask = torch.zeros((len(completions), R), dtype=torch.long)
    log_probs = torch.zeros((len(completions), R), dtype=torch.float32)
    for row, c in enumerate(completions):
        length = len(c.token_ids)
        response[row, :length] = torch.tensor(c.token_ids, dtype=torch.long)
        response_mask[row, :length] = 1
        log_probs[row, :length] = torch.tensor(c.log_probs, dtype=torch.float32)
    return response, response_mask, log_probs


def multi_modal_prompts(batch: TensorDict) -> list[MultiModalPrompt | None] | None:
    """Each prompt's images (``multi_modal_inputs`` and ``multi_modal_data``), or ``None`` for a text batch."""
    if K.MULTI_MODAL_INPUTS not in batch.keys():
        return None
    inputs = per_row(batch, K.MULTI_MODAL_INPUTS)
    data = per_row(batch, K.MULTI_MODAL_DATA) if K.MULTI_MODAL_DATA in batch.keys() else [{}] * len(inputs)
    prompts = [MultiModalPrompt(i, tuple((d or {}).get("image", ()))) if i else None for i, d in zip(inputs, data)]
    return prompts if any(prompts) else None


def unpadded(prompt_ids, prompt_mask) -> list[list[int]]:
    """Left-padded ``[B, P]`` prompts -> B lists of their real token ids."""
    lengths = prompt_mask.sum(-1).tolist()
    return [row.tolist() for row in torch.split(prompt_ids[prompt_mask.bool()], lengths)]
