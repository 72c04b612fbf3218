"""Multi-token prediction (verl's ``model.mtp.*``) with megatron-core's MTP block.

With ``MegatronStrategy(mtp=MTPOptions(...))`` the trained policy's ``GPTModel`` gets ``mtp_num_layers`` MTP layers
(the checkpoint's, :mod:`rlflow.models.mimo`; loaded and saved under its names by :mod:`.slots`). Layer ``k`` reads
the decoder's final states at position ``j`` with the embedding of token ``j + 1 + k`` and predicts token
``j + 2 + k`` through the shared output layer. With ``train=True`` each update pass adds, as verl does,

    ``mtp_loss_scaling_factor / mtp_num_layers * sum_k CE_k``

to the actor's loss, ``CE_k`` the cross-entropy of layer ``k`` over the response tokens it predicts (verl's
``loss_mask``: the response mask of the predicted token). rlflow normalises it as the token-mean policy loss: each
micro-batch adds its CE sum over the mini-batch's response-token count, so the gradient does not depend on how a
mini-batch is split (Megatron averages per-micro-batch means). The output layer gets no gradient from it (verl
detaches it); ``detach_encoder`` also stops it at the decoder's states and the token embeddings, so it trains the
MTP layers alone. The log-probs of the policy loss do not change: the MTP block runs beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlflow.models.mimo import MTP_PREFIX, mtp_layer_count, mtp_weights
from rlflow.strategies.megatron.model import MegatronLM

METRIC = "actor/mtp_losses/mtp_{}_loss"  # verl's name (mtp_losses/mtp_1_loss), under the actor's metrics


@dataclass(frozen=True)
class MTPOptions:
    """verl's ``model.mtp``: ``train`` (``enable_train``), ``loss_scaling_factor`` (``mtp_loss_scaling_factor``),
    ``detach_encoder``. ``train=False`` carries the MTP layers (loaded, checkpointed) without training them."""

    train: bool = False
    loss_scaling_factor: float = 0.1
    detach_encoder: bool = False


@dataclass
class MTPLosses:
    """What the update passes of the policy leave for the Trainer: each pass's per-layer CE sums and token counts.

    ``Policy.with_auxiliary_loss`` takes them after each micro-batch's loss (``take``)."""

    options: MTPOptions
    layers: int
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def record(self, sums: Tensor, counts: Tensor) -> None:
        self.pending.append((sums, counts))

    def take(self, num_tokens: float) -> tuple[Tensor, dict[str, float]] | None:
        """The loss term of the passes since the last call (``num_tokens``: the mini-batch's response tokens per
        process, the policy loss's token-mean divisor) and each layer's mean CE, or ``None`` when nothing ran."""
        if not self.pending:
            return None
        sums = torch.stack([s for s, _ in self.pending]).sum(0)
        counts = torch.stack([c for _, c in self.pending]).sum(0)
        self.pending.clear()
        loss = self.options.loss_scaling_factor / self.layers * sums.sum() / max(float(num_tokens), 1.0)
        means = (sums.detach() / counts.clamp_min(1)).tolist()
        return loss, {METRIC.format(k + 1): m for k, m in enumerate(means)}


def mtp_states(lm: MegatronLM, hidden: Tensor, ids: Tensor, detach_encoder: bool) -> list[Tensor]:
    """The final states ``[S, B, H]`` of every MTP layer, from the decoder's ``hidden`` (``[S, B, H]``, final-norm) and
    the batch's token ids ``B x S`` (each row's real tokens first): megatron-core's ``MultiTokenPredictionBlock``."""
    S = ids.shape[1]
    rotary, mask = lm.rotary_and_mask(S, ids.device)
    positions = torch.arange(S, device=ids.device)[None].expand_as(ids)

    def embedding(input_ids: Tensor, position_ids: Tensor) -> Tensor:
        out = lm.gpt.embedding(input_ids=input_ids, position_ids=position_ids)
        return out.detach() if detach_encoder else out

    out = lm.gpt.mtp(input_ids=ids, position_ids=positions, hidden_states=hidden.detach() if detach_encoder else hidden,
                     attention_mask=mask, rotary_pos_emb=rotary, embedding=embedding)
    return list(out.chunk(1 + lm.config.mtp_num_layers, dim=0)[1:])


def config_overrides(options: MTPOptions, config) -> dict:
    """``TransformerConfig`` fields of the MTP block for a checkpoint's config; an error when it has no MTP layers."""
    layers = mtp_layer_count(config)
    if not layers:
        raise ValueError(f"multi-token prediction (mtp): model_type={config.model_type!r} has no MTP layers "
                         "(num_nextn_predict_layers is 0 or absent); it needs a checkpoint with them, such as MiMo's")
    return {"mtp_num_layers": layers, "mtp_loss_scaling_factor": options.loss_scaling_factor}


def with_mtp_weights(state: dict[str, Tensor], hf_model) -> dict[str, Tensor]:
    """The Hugging Face state plus the MTP tensors, read from the model's folder when its class does not hold them
    (:func:`rlflow.models.mimo.register`'s MiMo)."""
    if any(name.startswith(MTP_PREFIX) for name in state):
        return state
    return state | mtp_weights(hf_model.name_or_path)


def attach(lm: MegatronLM, options: MTPOptions, module) -> None:
    """Training: the policy's passes record their MTP losses in one :class:`MTPLosses`, which ``module`` (the
    ``TokenLogProbs`` Fabric forwards attribute reads to) shares with ``Policy``. Not training: frozen MTP layers."""
    if options.train:
        lm.mtp_losses = module.mtp_losses = MTPLosses(options, lm.config.mtp_num_layers)
    else:
        lm.gpt.mtp.requires_grad_(False)


def engine_slots(slots: list) -> list:
    """The slots weight sync sends to a generation engine: not the MTP layers (rlflow's engines do not draft with
    them: no speculative decoding; vLLM's MiMo model drops ``model.mtp_layers.*`` on load)."""
    return [s for s in slots if not s.name.startswith(MTP_PREFIX)]
