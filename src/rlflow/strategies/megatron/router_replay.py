"""MoE routing replay (verl's ``router_replay.mode=R2`` and ``R3``) with megatron-core's ``RouterReplay``.

Off-policy updates of a MoE policy see two sources of change between the pass that scored the samples and the
update: the weights of the experts, and which experts each token goes to. Routing replay removes the second:
the update routes every token to the experts the old-log-prob pass chose for it, so the PPO ratio compares the
same computation path (verl's R2; its R3 records the routing in the rollout engine instead).

megatron-core 0.16.1 has the mechanism: with ``TransformerConfig(moe_enable_routing_replay=True)`` each router
holds a ``RouterReplay`` that records its top-k expert indices (``RECORD``) or uses given ones instead of its own
top-k (``REPLAY_FORWARD``; the router's probabilities are then its scores at those experts). This module drives
the routers of one model:

- a pass **without gradients** (the policy's old-log-prob pass) records: each row's routing ``[layers, n, k]``
  (``n`` its tokens, as the decoder reads them: real prompt tokens, then the response, trailing padding cut) is
  kept under the row's tokens. The first such pass after an update starts a new record, the first update after
  a record shares it between the data-parallel ranks (``balance_batch`` may move rows between replicas);
- a pass **with gradients** (the update) replays: each micro-batch's rows are looked up by their tokens (so any
  split or order of the mini-batches finds them), and positions the record does not cover (padding, padding
  rows) get experts ``0..k-1``: they come after every real token, so no real token sees them. With nothing
  recorded (an on-policy update whose old log-probs were its own) the routers route as usual.

In ``R3`` mode the routing comes from the rollout instead (``rlflow.rollout.engines.routing``: the experts each token
was routed to while it was generated, carried in the batch as ``prompt_routed_experts`` / ``routed_experts``):
every pass of the policy, the old-log-prob pass included, replays each row's own rollout routing, so both sides of
the importance ratio route as the sampler did; positions the rollout did not route (padding, the last token) get
experts ``0..k-1``, as above. An update without that routing is an error; a pass without gradients routes as usual.

The routing of a row depends only on its tokens and the weights, so equal rows (a prompt's identical samples)
share a record. A frozen reference is a model of its own, with no replay; the adapter-disabled reference of a
LoRA policy does not record. The replay indices stay set until the next pass, so a recomputation in the backward
pass (Megatron's activation recomputation on GPUs) routes as the forward did.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RoutingReplay:
    """Records and replays the routing of this rank's MoE routers (see the module docstring)."""

    def __init__(self, lm: nn.Module, pad_id: int, mode: str = "R2"):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if mode not in ("R2", "R3"):
            raise ValueError(f"router_replay: {mode!r} is not a mode: R2 (the old-log-prob pass's routing) or R3 (the "
                             "rollout's)")
        self.lm, self.pad_id, self.mode = lm, pad_id, mode
        routed = [layer for layer in lm.gpt.decoder.layers
                  if getattr(getattr(layer.mlp, "router", None), "router_replay", None) is not None]
        self.replays = [layer.mlp.router.router_replay for layer in routed]
        freq, layers = lm.config.moe_layer_freq, lm.config.num_layers  # megatron-core's pattern of MoE layers
        pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else list(freq)
        self.moe_layers = sum(pattern)
        self.ordinals = [sum(pattern[: layer.layer_number - 1]) for layer in routed]  # in the rollout's L dimension
        # megatron-core keeps every instance in a class-level list (for its global setters): this model drives its own
        for replay in self.replays:
            if replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(replay)
        self.topk = lm.config.moe_router_topk
        self.records: dict[bytes, Tensor] = {}  # row tokens -> layers x n x k expert indices
        self.replayed = False  # an update ran since the last record: the next no-grad pass starts anew
        self.counts = {"recorded": 0, "replayed": 0}  # rows, for the tests and the curious

    def _keys(self, ids: Tensor, rows: int) -> list[tuple[bytes, int]]:
        """Each row's tokens (trailing padding cut) as a key, and their number."""
        keys = []
        for row in ids[:rows]:
            real = (row != self.pad_id).nonzero()
            n = int(real[-1]) + 1 if real.numel() else 0
            keys.append((row[:n].cpu().numpy().tobytes(), n))
        return keys

    def _adapter_off(self) -> bool:
        return any(not adapter.active() for adapter in getattr(self.lm, "lora", ()))

    def start(self, ids: Tensor, rows: int, routing: Tensor | None = None) -> None:
        """Before a pass over ``ids`` (``B' x S`` as the decoder reads them; the first ``rows`` are real);
        ``routing``: in R3 mode the rollout's, ``rows x S x L x k`` in the same layout (-1: not routed)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action

        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
        if not self.replays or self._adapter_off():
            return
        if self.mode == "R3":
            self._from_rollout(ids, rows, routing)
            return
        if not torch.is_grad_enabled():
            if self.replayed:
                self.records.clear()
                self.replayed = False
            for replay in self.replays:
                replay.set_router_replay_action(Action.RECORD)
            return
        if not self.replayed:
            self._share()
        self.replayed = True
        keys = self._keys(ids, rows)
        if not self.records:
            return
        missing = sum(key not in self.records for key, _ in keys)
        if missing:
            raise RuntimeError(f"MoE routing replay (R2): {missing} of {rows} rows have no recorded routing (the "
                               "update's rows must be scored without gradients first: the old-log-prob pass)")
        S, width = ids.shape[1], ids.shape[0]
        filler = torch.arange(self.topk, device=ids.device)
        for layer, replay in enumerate(self.replays):
            target = filler.expand(S, width, self.topk).clone()  # S x B' x k, as the router sees the tokens
            for i, (key, n) in enumerate(keys):
                target[:n, i] = self.records[key][layer].to(ids.device)
            replay.set_target_indices(target.reshape(S * width, self.topk))
            replay.set_router_replay_action(Action.REPLAY_FORWARD)
        self.counts["replayed"] += rows

    def _from_rollout(self, ids: Tensor, rows: int, routing: Tensor | None) -> None:
        """R3: replay ``routing``, the rollout's."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action

        if routing is None:
            if torch.is_grad_enabled():
                raise RuntimeError("MoE routing replay from the rollout (R3): the update's batch has no routed_experts "
                                   "(a rollout with return_routed_experts=True writes them: verl's "
                                   "rollout.enable_rollout_routing_replay=True with rollout.name=hf)")
            return
        if routing.shape[2:] != (self.moe_layers, self.topk):
            raise ValueError(f"MoE routing replay from the rollout (R3): the batch's routed_experts has "
                             f"{tuple(routing.shape[2:])} (MoE layers, k) per token; this model has "
                             f"({self.moe_layers}, {self.topk})")
        S, width = ids.shape[1], ids.shape[0]
        filler = torch.arange(self.topk, device=ids.device)
        routing = routing.to(ids.device).long().transpose(0, 1)  # S x rows x L x k, as the router sees the tokens
        for ordinal, replay in zip(self.ordinals, self.replays):
            target = filler.expand(S, width, self.topk).clone()
            given = routing[:, :, ordinal]
            target[: given.shape[0], :rows] = torch.where(given[..., :1] >= 0, given, filler)
            replay.set_target_indices(target.reshape(S * width, self.topk))
            replay.set_router_replay_action(Action.REPLAY_FORWARD)
        self.counts["replayed"] += rows

    def _share(self) -> None:
        """Every data-parallel rank's records on every one: the update may train on rows another replica scored
        (``balance_batch`` moves rows between replicas). Ranks of one pipeline stage hold the same routers."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.records, group=group)
        for records in everyone:
            self.records.update(records)

    def finish(self, ids: Tensor, rows: int) -> None:
        """After the pass: keep what a recording pass recorded."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action

        if not self.replays or self.replays[0].router_replay_action != Action.RECORD:
            return
        S, width = ids.shape[1], ids.shape[0]
        recorded = torch.stack([r.get_recorded_indices().view(S, width, self.topk) for r in self.replays])
        for i, (key, n) in enumerate(self._keys(ids, rows)):
            self.records[key] = recorded[:, :n, i].cpu()
        self.counts["recorded"] += rows
        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
