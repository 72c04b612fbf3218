"""The policy's log-probs and entropy, and the critic's values, from a megatron-core model.

:class:`MegatronLogProbs` and :class:`MegatronValueModel` take the place of
:class:`~rlflow.models.logprobs.TokenLogProbs` and :class:`~rlflow.models.critic.ValueHeadModel`
(same ``forward`` arguments and outputs), so ``Policy.log_probs`` and ``Critic.values`` run unchanged.

The vocabulary stays split over the tensor-parallel ranks: each rank turns its hidden states into the
logits of its own ``V / tp`` columns and three all-reduces of ``N``-vectors give the log-softmax
of the chosen tokens and the entropy. Full logits are never gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlflow.models.head import auto_chunk_tokens
from rlflow.models.packing import response_lengths
from rlflow.strategies.megatron.model import MegatronLM
from rlflow.strategies.megatron.mtp import mtp_states
from rlflow.strategies.megatron.pipeline import run_stages


def vocab_parallel_log_probs(logits: Tensor, local_ids: Tensor, group=None) -> tuple[Tensor, Tensor]:
    """Log-softmax at the chosen tokens and entropy, from vocabulary-split logits.

    With ``z`` the full logits (split column-wise over ``group``), ``s = z - m`` (``m = max z``, an
    all-reduce max), and three sums over the vocabulary, each the sum of the ranks' partial sums:
    ``Z = sum_v exp(s_v)``, ``E = sum_v exp(s_v) s_v`` and ``s_y`` (the chosen token's column lives on
    one rank; the others add 0):

    ``log p(y) = s_y - log Z`` and ``H = log Z - E / Z``.

    The sums use Megatron's ``reduce_from_tensor_model_parallel_region``: forward all-reduce, backward
    identity. That is exact because each sum reduces purely local terms and everything after it is the
    same on every rank (every rank computes the same loss): the gradient of a sum reaches each rank's
    own columns once. (Dividing local terms by the reduced ``Z`` before a second sum would not be: the
    gradient with respect to ``Z`` would then miss the other ranks' terms.)

    Args:
        logits: ``N x V_local`` float32 (temperature already applied).
        local_ids: ``N`` chosen token ids minus this rank's first column (outside ``[0, V_local)``: another rank's),
            or ``N x J`` for several tokens per position (a distillation teacher's top-k besides the sampled one).
        group: the tensor-parallel group (``None``: Megatron's).

    Returns:
        log-probs (shaped as ``local_ids``) and entropy ``N``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce_sum

    group = group or ps.get_tensor_model_parallel_group()
    with torch.no_grad():
        top = logits.max(-1).values
        if dist.get_world_size(group) > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top[:, None]
    exp = shifted.exp()
    partition = reduce_sum(exp.sum(-1), group)
    weighted = reduce_sum((exp * shifted).sum(-1), group)
    ids = local_ids[:, None] if local_ids.dim() == 1 else local_ids
    mine = (ids >= 0) & (ids < logits.shape[-1])
    chosen = reduce_sum(shifted.gather(-1, ids.clamp(0, logits.shape[-1] - 1)) * mine, group)
    log_z = partition.log()
    log_probs = chosen - log_z[:, None]
    return (log_probs[:, 0] if local_ids.dim() == 1 else log_probs), log_z - weighted / partition


@dataclass
class _Tokens:
    """A batch as the decoder reads it: each row's real prompt tokens, its response, then padding."""

    ids: Tensor       # B' x S (B' >= B when rows are added to equalise expert-parallel ranks)
    predict: Tensor   # B x R: the position whose state predicts each response token
    source: Tensor    # B x S: the column of cat(prompt, response) each position reads (>= P + R: padding)


def _tokens(lm: MegatronLM, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor) -> _Tokens:
    """Left-padded prompts + right-padded responses -> rows that start with their real tokens.

    Row ``i`` with ``p_i`` real prompt tokens becomes ``prompt[i, P - p_i:] + response[i] + padding``: its
    positions are ``0, 1, ...`` as transformers' ``cumsum(mask) - 1``, real tokens never attend to padding
    under a causal mask, and response token ``t`` is predicted at position ``p_i - 1 + t``. (The response
    attends fully, as in the Hugging Face path: tool tokens inside it are seen by later ones.)
    """
    (B, P), R = prompt_ids.shape, response_ids.shape[1]
    real = prompt_mask.long().sum(-1).clamp_min(1)
    chunk = lm.sequence_chunk()
    S = -(-(int(real.max()) + R) // chunk) * chunk  # sequence parallelism splits the positions evenly
    source = torch.arange(S, device=prompt_ids.device)[None] + (P - real)[:, None]  # B x S columns to read
    pad = lm.padding_idx if lm.padding_idx is not None else 0
    ids = torch.cat([prompt_ids, response_ids], dim=1).gather(1, source.clamp(max=P + R - 1))
    ids = ids.masked_fill(source >= P + R, pad)
    predict = real[:, None] - 1 + torch.arange(R, device=prompt_ids.device)[None]
    group = _equal_shapes(lm)
    if group is not None:
        shape = torch.tensor(ids.shape, device=ids.device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
        padded = ids.new_full(tuple(shape.tolist()), pad)
        padded[:B, :S] = ids
        ids = padded
    return _Tokens(ids, predict, source)


def _routing(tokens: _Tokens, prompt_routing: Tensor, response_routing: Tensor, P: int, R: int) -> Tensor:
    """The rollout's routing (``B x P x L x k`` aligned with the prompt, ``B x R x L x k`` with the response) in the
    decoder's layout of ``tokens``: ``B x S x L x k``, -1 where nothing was routed."""
    full = torch.cat([prompt_routing[:, prompt_routing.shape[1] - P :], response_routing[:, :R]], dim=1)
    B, S = tokens.source.shape
    column = tokens.source.clamp(max=P + R - 1).to(full.device)[..., None, None].expand(B, S, *full.shape[2:])
    return full.gather(1, column).masked_fill((tokens.source >= P + R).to(full.device)[..., None, None], -1)


def _equal_shapes(lm: MegatronLM):
    """The process group whose ranks must feed the MoE layers equally many tokens, or ``None``.

    Megatron's all-gather token dispatcher (rlflow's choice on CPU: its all-to-all one needs a CUDA stream)
    gathers every rank's tokens with a fixed-size all-gather over the expert (tensor x expert parallel)
    group, and the ranks of that group hold different samples. So their batches are padded to the group's
    largest ``B x S``: extra rows and trailing columns are padding (after every real token under the causal
    mask), and an MoE layer without token dropping routes each token on its own, so real tokens' outputs do
    not change.
    """
    if getattr(lm.config, "num_moe_experts", None) is None or lm.config.moe_token_dispatcher_type != "allgather":
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_and_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def _response_states(hidden: Tensor, predict: Tensor) -> Tensor:
    """``[S, B', H]`` -> ``B*R x H``: the states at the positions that predict each response token."""
    B, R = predict.shape
    rows = hidden.transpose(0, 1)[:B]  # hidden: the full sequence (MegatronLM.full_sequence)
    return rows.gather(1, predict[..., None].expand(B, R, rows.shape[-1])).reshape(B * R, -1)


def _trailing_zeros(out: Tensor, response_mask: Tensor | None, remove_padding: bool) -> Tensor:
    """With ``remove_padding`` the Hugging Face path returns 0 after each response's end: so does this one."""
    if not remove_padding or response_mask is None:
        return out
    kept = torch.arange(out.shape[1], device=out.device)[None] < response_lengths(response_mask)[:, None]
    return out * kept[..., None]  # out: B x R x k


class MegatronLogProbs(nn.Module):
    """``TokenLogProbs`` on a megatron-core model: ``forward`` -> log-probs and entropy ``B x R``.

    Args:
        lm: this rank's :class:`~rlflow.strategies.megatron.model.MegatronLM`.
        temperature, chunk_tokens, remove_padding: as ``TokenLogProbs``' (rows are not packed together:
            megatron-core's local attention has no packed-sequence kernel; ``remove_padding`` zeroes the
            positions after each response's end, as the packed Hugging Face path does).
    """

    state_prefix = "lm."  # the Hugging Face weights' prefix in the module's checkpoint (TokenLogProbs.lm)

    def __init__(self, lm: MegatronLM, temperature: float = 1.0, chunk_tokens: int | None = None,
                 remove_padding: bool = False):
        super().__init__()
        if chunk_tokens is None:  # as TokenLogProbs: a chunk's float32 logits (this rank's vocabulary rows) fit a budget
            chunk_tokens = auto_chunk_tokens(lm.vocab_local)
        self.lm, self.temperature, self.chunk_tokens = lm, temperature, chunk_tokens
        self.remove_padding = remove_padding

    def _chunk(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """``ids``: ``n x J`` -> ``n x (J + 1)``: the ``J`` log-probs, then the entropy."""
        logits = self.lm.logits(hidden).float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        log_probs, entropy = vocab_parallel_log_probs(logits, ids - self.lm.vocab_start)
        return torch.cat([log_probs, entropy[:, None]], dim=-1)

    def _head(self, hidden: Tensor, predict: Tensor, scored: Tensor) -> Tensor:
        states, ids = _response_states(hidden, predict), scored.reshape(predict.numel(), -1)
        parts = []
        for start in range(0, ids.shape[0], self.chunk_tokens):  # the head's logits are recomputed in the backward
            h, i = states[start : start + self.chunk_tokens], ids[start : start + self.chunk_tokens]
            grad = torch.is_grad_enabled() and h.requires_grad
            parts.append(checkpoint(self._chunk, h, i, use_reentrant=False) if grad else self._chunk(h, i))
        width = ids.shape[1] + 1
        out = torch.cat(parts) if parts else states.sum(-1, keepdim=True)[:0].float().expand(0, width)
        return out.view(*predict.shape, width)

    def _mtp_chunk(self, hidden: Tensor, ids: Tensor) -> Tensor:
        """The MTP layers' log-probs of ``ids`` (temperature 1; the output layer's weight detached, as verl's)."""
        logits = self.lm.logits(hidden, detach_weight=True).float()
        return vocab_parallel_log_probs(logits, ids - self.lm.vocab_start)[0]

    def _mtp_losses(self, hidden: Tensor, tokens: _Tokens, response_ids: Tensor, response_mask: Tensor,
                    detach_encoder: bool) -> tuple[Tensor, Tensor]:
        """Each MTP layer's cross-entropy sum over the response tokens it predicts, and their count (:mod:`.mtp`):
        layer ``k`` predicts response token ``t`` from the position ``1 + k`` before the main head's."""
        (B, R), sums, counts = response_ids.shape, [], []
        for k, states in enumerate(mtp_states(self.lm, hidden, tokens.ids, detach_encoder)):
            at = tokens.predict - (1 + k)
            valid = (at >= 0) & response_mask.bool()
            picked = _response_states(states, at.clamp_min(0)).view(B, R, -1)[valid]
            ids = response_ids[valid]
            parts = [checkpoint(self._mtp_chunk, picked[i : i + self.chunk_tokens], ids[i : i + self.chunk_tokens],
                                use_reentrant=False) for i in range(0, ids.numel(), self.chunk_tokens)]
            sums.append(-torch.cat(parts).sum() if parts else picked.sum() * 0.0)
            counts.append(valid.sum().float())
        return torch.stack(sums), torch.stack(counts)

    @property
    def replays_rollout_routing(self) -> bool:
        """Whether :meth:`forward` takes ``routed_experts`` (``MegatronStrategy(router_replay="R3")``)."""
        replay = getattr(self.lm, "routing_replay", None)
        return replay is not None and replay.mode == "R3"

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor | None = None, topk_ids: Tensor | None = None,
                routed_experts: tuple[Tensor, Tensor] | None = None,
                multi_modal: list[dict] | None = None) -> tuple[Tensor, ...]:
        """Shapes: prompt ``B x P`` (left-padded), response ``B x R`` -> log-probs, entropy ``B x R``; with
        ``topk_ids`` (``B x R x k``) also their log-probs ``B x R x k``, as ``TokenLogProbs``. ``routed_experts``:
        the rollout's routing of the prompt and the response tokens, replayed in R3 mode. ``multi_modal``: a
        vision-language model's per-row processor outputs, as ``TokenLogProbs``' (:mod:`.vision`)."""
        B, R = response_ids.shape
        scored = response_ids[..., None] if topk_ids is None else torch.cat([response_ids[..., None], topk_ids], -1)
        width = scored.shape[-1] + 1
        tokens = _tokens(self.lm, prompt_ids, prompt_mask, response_ids)
        images = None if self.lm.vision is None else self.lm.vision.batch(
            prompt_ids, prompt_mask, response_ids, multi_modal, tokens.source, tuple(tokens.ids.shape))
        replay = getattr(self.lm, "routing_replay", None)  # MoE routing replay (.router_replay), when on
        if replay is not None:
            given = None
            if routed_experts is not None and replay.mode == "R3":
                given = _routing(tokens, *routed_experts, prompt_ids.shape[1], R)
            replay.start(tokens.ids, B, given)
        mtp = getattr(self.lm, "mtp_losses", None)  # .mtp: trained MTP layers add their loss in update passes
        train_mtp = mtp is not None and torch.is_grad_enabled() and response_mask is not None

        def head(hidden: Tensor) -> Tensor:
            hidden = self.lm.full_sequence(hidden)
            if train_mtp:
                mtp.record(*self._mtp_losses(hidden, tokens, response_ids, response_mask, mtp.options.detach_encoder))
            return self._head(hidden, tokens.predict, scored)

        out = run_stages(self.lm, tokens.ids, head, (B, R, width), images)
        if replay is not None:
            replay.finish(tokens.ids, B)
        out = _trailing_zeros(out, response_mask, self.remove_padding)
        if topk_ids is None:
            return out[..., 0], out[..., -1]
        return out[..., 0], out[..., -1], out[..., 1:-1]


class MegatronValueModel(nn.Module):
    """``ValueHeadModel`` on a megatron-core model: ``forward`` -> values ``B x R``.

    The value head (``hidden -> 1``) lives on the last pipeline stage, whole on every tensor-parallel
    rank (its input is the same on all of them, so are its gradients).
    """

    state_prefix = "lm."

    def __init__(self, lm: MegatronLM, value_head: nn.Linear, remove_padding: bool = False):
        super().__init__()
        self.lm, self.remove_padding = lm, remove_padding
        self.value_head = value_head if lm.last_stage else None

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor | None = None) -> Tensor:
        B, R = response_ids.shape
        tokens = _tokens(self.lm, prompt_ids, prompt_mask, response_ids)

        def head(hidden: Tensor) -> Tensor:
            states = _response_states(self.lm.full_sequence(hidden), tokens.predict)
            return self.value_head(states).float().view(B, R, 1)

        out = run_stages(self.lm, tokens.ids, head, (B, R, 1))
        return _trailing_zeros(out, response_mask, self.remove_padding)[..., 0]
