"""The MoE experts a transformers model routes each token to while it generates (verl's R3, the rollout's side).

:class:`RoutingRecorder` hooks the router of every MoE layer (``layer.mlp.gate``, which in transformers' MoE models
returns ``(logits, weights, top-k indices)``) for one ``generate`` call: the prefill routes the prompt's columns, each
decoding step one column, so what it returns is ``[rows, P + R, L, k]`` over the left-padded prompt and the
response, ``-1`` where nothing was routed (the last token, which is never fed back). The training side replays it:
``MegatronStrategy(router_replay="R3")`` (:mod:`rlflow.strategies.megatron.router_replay`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of each MoE layer of a transformers causal LM, in layer order."""
    layers = getattr(model.get_decoder(), "layers", ())
    return [layer.mlp.gate for layer in layers
            if hasattr(getattr(layer, "mlp", None), "experts") and hasattr(layer.mlp, "gate")]


class RoutingRecorder:
    """Records, inside ``with``, the top-k experts every MoE router of ``model`` picks for ``rows`` rows."""

    def __init__(self, model: nn.Module, rows: int):
        self.routers, self.rows = moe_routers(model), rows
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE layers: recording the routed experts "
                             "(return_routed_experts, verl's enable_rollout_routing_replay) needs a MoE model")
        self.columns: list[list[Tensor]] = [[] for _ in self.routers]  # per layer: rows x T x k per forward

    def _hook(self, layer: int):
        def record(module, args, out):
            indices = out[-1] if isinstance(out, tuple) else None
            if indices is None or indices.is_floating_point():
                raise NotImplementedError(f"{type(module).__name__}: rlflow records the routing of routers that return "
                                          "their top-k expert indices (transformers' Qwen3-MoE, Mixtral, ...)")
            self.columns[layer].append(indices.detach().reshape(self.rows, -1, indices.shape[-1]).to(torch.int16))
        return record

    def __enter__(self) -> RoutingRecorder:
        self.hooks = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> bool:
        for hook in self.hooks:
            hook.remove()
        return False

    def routing(self, length: int) -> Tensor:
        """``rows x length x L x k``: the recorded columns, then -1 (the token no forward saw)."""
        recorded = torch.stack([torch.cat(columns, 1) for columns in self.columns], 2)[:, :length]
        out = recorded.new_full((self.rows, length, *recorded.shape[2:]), -1)
        out[:, : recorded.shape[1]] = recorded
        return out
