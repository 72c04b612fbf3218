"""SingleTurnRollout: prompts in a TensorDict -> ``n`` sampled responses each, with any engine.

It does what every single-turn rollout does whatever samples the tokens: strip the prompts' left padding,
ask the engine for ``n`` completions per prompt, and lay them out as right-padded tensors with their mask,
the sampler's log-probs, group ids and decoded text. The engine is built without a model and bound to the
trained one in :meth:`SingleTurnRollout.bind`, so one rollout class serves every engine: ``HFRollout``,
``VLLMRollout`` and ``ServerRollout`` are this class with an engine built for them from their options.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from tensordict import TensorDict

from rlflow.data import keys as K
from rlflow.data.nontensor import per_row, repeat_interleave, shallow_copy, stack
from rlflow.module import BatchModule
from rlflow.rollout.engines.base import Completion, Engine, MultiModalPrompt, SamplingParams
from rlflow.rollout.weight_sync import DEFAULT_BUCKET_BYTES, update_buckets

# the rollout's sampling options (with_options takes them) -> their SamplingParams field
SAMPLING_FIELDS = {"n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "max_new_tokens": "max_new_tokens", "do_sample": "greedy", "seed": "seed",
                   "stop_token_ids": "stop_token_ids"}
SAMPLING_OPTIONS = tuple(SAMPLING_FIELDS)


def sampling_option(name: str) -> property:
    """The rollout's option ``name``, read from its :class:`SamplingParams` (``do_sample`` is ``not greedy``)."""
    field = SAMPLING_FIELDS.get(name, name)
    if name == "do_sample":
        return property(lambda self: not self.sampling.greedy, doc="False for greedy decoding.")
    return property(lambda self: getattr(self.sampling, field), doc=f"``sampling.{field}``.")


class SingleTurnRollout(BatchModule):
    """Turns prompts into ``n`` samples each with an :class:`~rlflow.rollout.engines.base.Engine`.

    Reads left-padded prompts; writes right-padded responses, a response mask that covers each completion
    (up to and including its stop/EOS token), the sampler's log-probs (temperature-scaled, before top-k/top-p
    truncation, as the policy computes them), a ``group`` id per prompt and the decoded text. Non-tensor
    prompt fields (ground truth, data source, ...) are repeated with their rows.

    Args:
        engine: the engine to sample with, bound to the model in :meth:`bind` (built without one:
            ``HFEngine()``, ``VLLMEngine(...)``, ``ServerEngine(url)``, or an engine class of your own).
        n: samples per prompt.
        temperature, top_p, top_k, max_new_tokens: sampling options (``top_k=-1``, ``top_p=1``: off).
        do_sample: ``False`` for greedy decoding.
        seed: seeds each call's sampling (``None``: the engine's random stream).
        stop_token_ids: tokens that end a response besides the tokenizer's EOS.
        ignore_eos: generation goes on past EOS (engines with ``supports_ignore_eos``).
        return_routed_experts: also write the MoE experts each token was routed to while it was generated
            (``prompt_routed_experts``, ``routed_experts``; engines with ``returns_routed_experts``): what
            ``MegatronStrategy(router_replay="R3")`` replays.
        sampling: all of the options above at once, as :class:`SamplingParams` (then give none of them).
        bucket_bytes: the most bytes of weights sent to the engine in one piece (``sync_weights``).

    ``bind(model, tokenizer)`` (the Trainer calls it) binds the engine to the trained model; when the engine
    holds weights of its own, they are loaded from ``model`` then, and again by ``sync_weights`` after every
    update, in buckets of at most ``bucket_bytes``.

    What wrappers (asynchronous rollouts, the agent loop) use: :attr:`engine`, :attr:`sampling` (the
    engine-neutral sampling parameters), :meth:`samples` (completions -> the rollout's batch),
    :attr:`bucket_bytes`, and :meth:`sample_with` to sample through an engine they run elsewhere.
    """

    in_keys = (K.PROMPT_IDS, K.PROMPT_MASK)
    out_keys = (K.RESPONSE_IDS, K.RESPONSE_MASK, K.ROLLOUT_LOG_PROBS, K.GROUP, K.RESPONSE_TEXT)
    # whether the engine this class builds takes images (vision-language prompts); the verl entry point refuses
    # a vision-language model with a rollout class that does not, before it builds anything
    makes_image_engine: bool = False

    n = sampling_option("n")
    temperature = sampling_option("temperature")
    top_p = sampling_option("top_p")
    top_k = sampling_option("top_k")
    max_new_tokens = sampling_option("max_new_tokens")
    do_sample = sampling_option("do_sample")
    seed = sampling_option("seed")
    stop_token_ids = sampling_option("stop_token_ids")
    ignore_eos = sampling_option("ignore_eos")
    return_routed_experts = sampling_option("return_routed_experts")

    def __init__(self, engine: Engine | None = None, n: int = 1, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, max_new_tokens: int = 512, do_sample: bool = True, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False, return_routed_experts: bool = False,
                 sampling: SamplingParams | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        options = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_new_tokens=max_new_tokens, greedy=not do_sample, seed=seed,
                                 stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                 return_routed_experts=return_routed_experts)
        if sampling is not None and options != SamplingParams():
            raise TypeError("SingleTurnRollout: give the sampling options either as sampling=SamplingParams(...) "
                            "or as keywords (n=..., temperature=...), not both")
        if engine is not None and not isinstance(engine, Engine):
            raise TypeError(f"engine ({type(engine).__name__}) is not an rlflow.rollout.engines.Engine: subclass "
                            "it and write generate (and bind, load_weights as needed); the base gives the rest")
        self.engine = engine
        self.sampling = sampling or options
        self.params  # an engine that cannot honour the options is refused now, not at the first rollout
        self.model = None
        self.tokenizer = None
        self.bucket_bytes = bucket_bytes

    @property
    def holds_own_weights(self) -> bool:
        """True when the engine keeps its own copy of the weights: the Trainer then binds the trained model
        itself (no copy, even when it is sharded) and every update is sent with ``sync_weights``."""
        return self.engine is not None and self.engine.holds_own_weights

    @property
    def stats(self) -> dict[str, float]:
        """The engine's metrics of the last call (e.g. a server's ``server/retries``); the Trainer logs them."""
        return dict(self.engine.stats) if self.engine is not None else {}

    @property
    def params(self) -> SamplingParams:
        """:attr:`sampling`, checked against the engine (``ignore_eos`` needs an engine that supports it)."""
        if self.sampling.ignore_eos and self.engine is not None and not self.engine.supports_ignore_eos:
            raise ValueError(f"ignore_eos: {type(self.engine).__name__} cannot generate past EOS here")
        if self.sampling.return_routed_experts and self.engine is not None and not self.engine.returns_routed_experts:
            raise NotImplementedError(f"return_routed_experts (MoE routing replay from the rollout, verl's R3): "
                                      f"{type(self.engine).__name__}: {self.engine.routed_experts_refusal}")
        return self.sampling

    # ------------------------------------------------------------------ engine and weights
    def bind(self, model, tokenizer) -> None:
        """Sample for ``model`` with ``tokenizer`` from now on: the engine is bound to them (an engine with its
        own weights starts and loads them now)."""
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__} has no engine: pass one (SingleTurnRollout(HFEngine(), ...)) "
                               "or use a rollout that builds one (HFRollout, VLLMRollout, ServerRollout)")
        self.model, self.tokenizer = model, tokenizer
        self.engine.bind(model, tokenizer)
        self.resync()

    def sample_with(self, engine: Engine, model, tokenizer) -> None:
        """Sample through ``engine``, already bound (a wrapper's engine in a child process or a thread), for
        ``model``; nothing is loaded. ``with_options`` copies made later sample through it too."""
        self.engine, self.model, self.tokenizer = engine, model, tokenizer

    def close(self) -> None:
        """Release what this rollout started (a server rollout stops its servers); engines shared with other
        rollouts (vLLM's, one per model shape) stay."""

    def resync(self) -> None:
        """Load the bound model's weights into an engine that holds another model's (a shared engine: tests,
        notebooks, a validation copy)."""
        if self.holds_own_weights and self.model is not None and self.engine.loaded_from is not self.model:
            self.sync_weights(self.model)

    def sync_weights(self, trained) -> dict[str, float]:
        """After an update, bring the engine's weights up to date with ``trained``.

        Nothing moves when the engine generates with ``trained`` itself (HF on one device or DDP); otherwise
        its parameters are gathered (from FSDP2 shards too) and loaded bucket by bucket, tied parameters under
        all their names. A LoRA policy sends merged weights (or the adapter to a PEFT copy), all of them the
        first time, then only what updates change (``rlflow.rollout.weight_sync.update_buckets``). Returns
        ``weight_sync/*`` metrics (buckets, GB moved, seconds).
        """
        if self.engine is None or self.engine.module is trained:
            return {}
        start = time.perf_counter()
        changed_only = self.engine.loaded_from is trained
        buckets = update_buckets(trained, self.engine.module, self.bucket_bytes, changed_only)
        metrics = self.engine.load_weights(buckets)
        self.engine.loaded_from = trained  # an engine shared by several rollouts knows whose weights it holds
        return metrics | {"weight_sync/seconds": time.perf_counter() - start}

    def with_options(self, **overrides) -> "SingleTurnRollout":
        """A copy with other sampling options (e.g. greedy validation), sharing engine, model and tokenizer."""
        unknown = set(overrides) - set(SAMPLING_OPTIONS)
        if unknown:
            raise TypeError(f"with_options: unknown option(s) {sorted(unknown)}; choose from {SAMPLING_OPTIONS}")
        fields = {SAMPLING_FIELDS[k]: (not v if k == "do_sample" else tuple(v) if k == "stop_token_ids" else v)
                  for k, v in overrides.items()}
        clone = copy.copy(self)
        clone.sampling = dataclasses.replace(self.sampling, **fields)  # validates
        clone.params
        return clone

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]],
                 multi_modal: list[MultiModalPrompt | None] | None = None) -> list[list[Completion]]:
        """The engine's completions for token-id prompts (``n`` each); checks none was lost or duplicated.

        ``multi_modal``: per prompt, its images (vision-language prompts; the engine must accept images).
        """
        if multi_modal is None:
            completions = self.engine.generate(prompts, self.params)
        elif not self.engine.accepts_images:
            raise TypeError(f"{type(self.engine).__name__} does not take images (accepts_images=False): "
                            "vision-language prompts need an engine that does (HFEngine, i.e. HFRollout)")
        else:
            completions = self.engine.generate(prompts, self.params, multi_modal)
        if len(completions) != len(prompts) or any(len(c) != self.n for c in completions):
            raise RuntimeError(f"{type(self.engine).__name__} returned {[len(c) for c in completions]} completions "
                               f"for {len(prompts)} prompts, expected {self.n} each")
        return completions

    def forward(self, batch: TensorDict) -> TensorDict:
        if self.engine is None or self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__} has no model: call rollout.bind(model, tokenizer) (the Trainer does)")
        self.resync()  # a shared engine loaded another model's weights since (tests, notebooks)
        ids, mask = batch.get(K.PROMPT_IDS), batch.get(K.PROMPT_MASK)
        images = multi_modal_prompts(batch)
        # engines that sample padded tensors (HF) skip the trip through lists; images take the list form
        sampled = self.engine.generate_tensors(ids, mask, self.params) if images is None else None
        if sampled is None:
            return self.samples(batch, self.generate(unpadded(ids, mask), images))
        return self.laid_out(batch, sampled)

    def samples(self, batch: TensorDict, completions: list[list[Completion]]) -> TensorDict:
        """Lay out the engine's completions (``n`` per prompt of ``batch``) as the rollout's batch."""
        flat = [c for per_prompt in completions for c in per_prompt]
        sampled = padded_completions(flat, self.tokenizer.pad_token_id)
        if self.return_routed_experts:
            sampled += padded_routing(flat, batch.get(K.PROMPT_MASK).repeat_interleave(self.n, 0), sampled[0].shape[1])
        return self.laid_out(batch, sampled)

    def laid_out(self, batch: TensorDict, sampled: tuple[torch.Tensor, ...]) -> TensorDict:
        """``batch``'s prompt rows repeated ``n`` times with the sampled ``(response_ids, response_mask, log_probs)``
        (and with ``return_routed_experts`` the prompt's and the response's routing), group ids and text."""
        num_prompts, ids = batch.batch_size[0], batch.get(K.PROMPT_IDS)
        response, response_mask, log_probs, *routing = (t.to(ids.device) for t in sampled)
        # shallow: tensordict's clone(False) rebuilds every non-tensor row; repeat_interleave shares them
        batch = repeat_interleave(batch, self.n) if self.n > 1 else shallow_copy(batch)
        batch[K.RESPONSE_IDS] = response
        batch[K.RESPONSE_MASK] = response_mask
        batch[K.ROLLOUT_LOG_PROBS] = log_probs
        if routing:
            batch[K.PROMPT_ROUTED_EXPERTS], batch[K.ROUTED_EXPERTS] = routing
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


def padded_routing(completions: list[Completion], prompt_mask: torch.Tensor, R: int) -> tuple[torch.Tensor, ...]:
    """The completions' ``routed_experts`` (real prompt tokens, then the completion's) -> the prompt's routing
    ``[N, P, L, k]`` aligned with the left-padded prompts and the response's ``[N, R, L, k]``, -1 on padding."""
    if any("routed_experts" not in c.extras for c in completions):
        raise RuntimeError("return_routed_experts: the engine returned completions without routed_experts")
    first = completions[0].extras["routed_experts"]
    prompt = torch.full((len(completions), prompt_mask.shape[1], *first.shape[1:]), -1, dtype=torch.int16)
    response = torch.full((len(completions), R, *first.shape[1:]), -1, dtype=torch.int16)
    for row, (c, real) in enumerate(zip(completions, prompt_mask.bool().cpu())):
        routing, p = torch.as_tensor(c.extras["routed_experts"], dtype=torch.int16), int(real.sum())
        prompt[row, real] = routing[:p]
        response[row, : len(routing) - p] = routing[p:]
    return prompt, response


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
