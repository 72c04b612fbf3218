"""The engine interface: *how* tokens are sampled, apart from *what* a rollout does with prompts.

An engine takes token-id prompts (no padding) and engine-neutral :class:`SamplingParams`, and returns, for
each prompt, ``n`` :class:`Completion` s carrying the sampled token ids and the sampler's log-prob of each
one. Engines that hold their own copy of the weights (an in-process vLLM, a server) receive the trained
weights through :meth:`Engine.load_weights` as size-bounded buckets of ``(name, tensor)`` pairs in Hugging
Face naming (``rlflow.weights.full_weight_buckets`` makes them from any strategy's parameters).

The log-prob contract: for the token :math:`y_t` sampled after context :math:`c_t`,

.. math:: \\log p(y_t \\mid c_t) = \\ell_{y_t}/T - \\log \\sum_v e^{\\ell_v / T}

with :math:`\\ell` the model's logits and :math:`T` the temperature, *before* top-k/top-p truncation: the
distribution the :class:`~rlflow.models.policy.Policy` recomputes. Greedy decoding reports :math:`T = 1`.

Images: a vision-language prompt is its token ids (image-pad tokens expanded, as the processor wrote them)
plus a :class:`MultiModalPrompt` at the same index of ``generate``'s ``multi_modal`` list. Engines that
take images set ``accepts_images``; the rollout refuses images to the others with a clear error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from torch import Tensor

from rlflow.weights import hf_weight_buckets, tied_aliases  # noqa: F401  (exported here too: engines use them)

WeightBuckets = Iterable[list[tuple[str, Tensor]]]


@dataclass(frozen=True)
class SamplingParams:
    """rlflow's own sampling options, translated by each engine.

    Attributes:
        n: completions per prompt.
        temperature: logits are divided by it before sampling (ignored when ``greedy``).
        top_p, top_k: nucleus / top-k truncation (``1.0`` / ``-1``: off); log-probs are reported before them.
        max_new_tokens: the most tokens a completion may have.
        greedy: argmax decoding (``do_sample=False``); log-probs are then those of :math:`T = 1`.
        seed: makes one call's sampling reproducible (``None``: the engine's own random stream).
        stop_token_ids: tokens that end a completion besides the tokenizer's EOS (included in the completion).
        ignore_eos: EOS does not end a completion (it runs to ``max_new_tokens`` or a ``stop_token_ids`` token),
            as vLLM's ``ignore_eos``; engines that cannot (``supports_ignore_eos`` false) refuse it.
        return_routed_experts: record the MoE experts each token is routed to while it is generated (MoE routing
            replay from the rollout, verl's R3); engines that cannot (``returns_routed_experts`` false) refuse it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    greedy: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_routed_experts: bool = False

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError("temperature must be > 0 when sampling; use greedy=True (do_sample=False) for argmax")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def scale_temperature(self) -> float:
        """The temperature the reported log-probs use: 1 for greedy decoding."""
        return 1.0 if self.greedy else self.temperature

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p cut the distribution that is sampled."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(frozen=True)
class MultiModalPrompt:
    """The images of one prompt, in both forms an engine may want.

    Attributes:
        inputs: the processor's tensors for this prompt (Qwen-VL: ``pixel_values`` ``[patches, D]``,
            ``image_grid_thw`` ``[images, 3]``): what a transformers model takes next to the token ids.
        images: the decoded images (PIL, RGB) in placeholder order: what an engine with its own processor
            (vLLM's ``multi_modal_data={"image": [...]}``, a server) takes.
    """

    inputs: dict = field(default_factory=dict)
    images: tuple = ()


@dataclass
class Completion:
    """One sampled continuation of one prompt.

    Attributes:
        token_ids: the generated tokens, the stop/EOS token included when it ended the completion.
        log_probs: the sampler's log-prob of each token (see the module docstring), ``len(token_ids)`` floats.
        finish_reason: ``"stop"`` (a stop/EOS token) or ``"length"`` (``max_new_tokens`` reached).
        extras: anything else an engine reports (e.g. ``policy_version`` for asynchronous rollouts;
            ``routed_experts``, ``[prompt + completion tokens, MoE layers, k]`` int16, with
            ``SamplingParams(return_routed_experts=True)``: -1 where nothing was routed).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(f"a completion has {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs")


class Engine:
    """Samples completions of token-id prompts. Subclasses implement :meth:`generate` and, when they hold
    their own copy of the weights (``holds_own_weights``), :meth:`load_weights`.

    An engine is built without a model (its own options only: ``HFEngine(cache_implementation="static")``,
    ``VLLMEngine(gpu_memory_utilization=0.5)``, ``ServerEngine(url)``) and bound to one later by :meth:`bind`,
    which a rollout's ``bind`` calls with the trained model and its tokenizer. A new engine is this one class:
    ``SingleTurnRollout(MyEngine(), n=8)`` samples with it.
    """

    #: True when the engine samples with weights of its own that must be sent after every update
    #: (vLLM, a server); False when it generates with the trained module itself.
    holds_own_weights: bool = False
    #: True when :meth:`generate` takes images (``multi_modal``).
    accepts_images: bool = False
    #: True when :class:`SamplingParams` ``ignore_eos`` is honoured (generation past EOS).
    supports_ignore_eos: bool = False
    #: True when :class:`SamplingParams` ``return_routed_experts`` is honoured; else ``routed_experts_refusal``
    #: says why not
    returns_routed_experts: bool = False
    routed_experts_refusal: str = "this engine does not record the experts it routes tokens to"
    #: True when the engine samples in another process of its own (a server): asynchronous rollouts drive it
    #: from a thread instead of starting it in a child process.
    remote: bool = False
    #: the torch module :meth:`generate` runs in this process, if any (HFEngine's model): an update of that very
    #: module needs no weight transfer
    module = None
    #: the model whose weights the engine holds (``holds_own_weights``), set by whoever loads them
    loaded_from = None
    #: metrics of the last call (e.g. a server's ``server/retries``), logged by the Trainer
    stats: Mapping[str, float] = MappingProxyType({})  # read-only: an engine with metrics assigns its own dict

    def bind(self, model, tokenizer) -> None:
        """Sample for ``model`` (a transformers model) with ``tokenizer`` from now on; engines that hold weights
        of their own start here (the rollout then sends ``model``'s weights with :meth:`load_weights`). Binding
        again rebinds. The default keeps nothing: an engine that needs neither (a fixed sampler) is bound as built."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 multi_modal: list[MultiModalPrompt | None] | None = None) -> list[list[Completion]]:
        """Token-id prompts (no padding) -> for each prompt, ``params.n`` completions.

        ``multi_modal`` (engines with ``accepts_images``): per prompt, its images or ``None``.
        """
        raise NotImplementedError

    def generate_tensors(self, prompt_ids: Tensor, prompt_mask: Tensor,
                         params: SamplingParams) -> tuple[Tensor, Tensor, Tensor] | None:
        """Optional tensor form of :meth:`generate` for engines that sample padded batches anyway (HF).

        Left-padded ``[B, P]`` prompts -> ``(response_ids, response_mask, log_probs)``, each ``[B * n, R]``
        with the ``n`` samples of a prompt in consecutive rows, laid out exactly as a rollout lays out
        :meth:`generate`'s completions (right-padded with the pad id / 0, ``R`` the longest completion).
        ``None`` (the default) means "use :meth:`generate`": it saves the trip through Python lists only.
        """
        return None

    async def agenerate(self, prompts: list[list[int]], params: SamplingParams,
                        multi_modal: list[MultiModalPrompt | None] | None = None) -> list[list[Completion]]:
        """:meth:`generate` on a worker thread, so an event loop (an agent loop, async rollouts) is not blocked."""
        if multi_modal is None:
            return await asyncio.to_thread(self.generate, prompts, params)
        return await asyncio.to_thread(self.generate, prompts, params, multi_modal)

    def load_weights(self, buckets: WeightBuckets) -> dict[str, float]:
        """Load ``[(hf_name, tensor), ...]`` buckets (one call for all of them, consumed bucket by bucket) and
        reset every cache computed with the old weights (prefix/KV caches).

        Returns metrics: ``weight_sync/buckets``, ``weight_sync/gb`` (bytes moved / 1e9), and engine-specific ones.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot receive weights")

    def keep_unavailable(self) -> str | None:
        """Why the engine cannot keep requests in flight across a weight update (FullyAsyncRollout's keep mode:
        ``submit_kept``, ``update_kept``, ...); ``None`` when it can (:class:`ServerEngine` on vLLM)."""
        return f"{type(self).__name__} cannot pause with its requests kept (vLLM's pause_generation(mode='keep'))"

    def sleep(self) -> None:
        """Free accelerator memory (KV cache, weights) while the trainer updates; no-op where there is none."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next generation."""

    def close(self) -> None:
        """Release the engine's resources (processes, memory, connections)."""


def counted(buckets: WeightBuckets, totals: dict[str, float]) -> Iterator[tuple[str, Tensor]]:
    """Yield the pairs of ``buckets`` one by one while counting buckets and bytes (each tensor once, however
    many names it has) into ``totals``."""
    for bucket in buckets:
        totals["weight_sync/buckets"] = totals.get("weight_sync/buckets", 0.0) + 1
        unique = {id(t): t for _, t in bucket}.values()
        totals["weight_sync/gb"] = totals.get("weight_sync/gb", 0.0) + sum(t.numel() * t.element_size() for t in unique) / 1e9
        yield from bucket
