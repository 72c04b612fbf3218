"""The MoE experts a transformers model routes each token to while it generates (verl's R3, the rollout's side).

:class:`RoutingRecorder` hooks the router of every MoE layer (``layer.mlp.gate``, which in transformers' MoE models
returns ``(logits, weights, top-k indices)``) for one ``generate`` call: the prefill routes the prompt's columns, each
decoding step one column, so what it returns is ``[rows, P + R, L, k]`` over the left-padded prompt and the
response, ``-1`` where nothing was routed (the last token, which is never fed back). The training side replays it:
``MegatronStrategy(router_replay="R3")`` (:mod:`rlflow.strategies.megatron.router_replay`).

vLLM records them itself (``enable_return_routed_experts``, on CUDA only): :func:`from_vllm` turns what it returns
into the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder-layer index of each MoE layer of a transformers causal LM (a layer whose MLP has ``experts``
    and a ``gate``), in order."""
    layers = getattr(model.get_decoder(), "layers", ())
    return [i for i, layer in enumerate(layers)
            if hasattr(getattr(layer, "mlp", None), "experts") and hasattr(layer.mlp, "gate")]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of each MoE layer of a transformers causal LM, in layer order."""
    layers = getattr(model.get_decoder(), "layers", ())
    return [layers[i].mlp.gate for i in moe_layer_indices(model)]


def config_moe_layers(config, trust_remote_code: bool = False) -> list[int]:
    """:func:`moe_layer_indices` of the model ``config`` describes, built on the meta device (no memory, no weights):
    which decoder layers are MoE layers is the model class's rule (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step``, DeepSeek's ``first_k_dense_replace``, ...), so it is read from the class itself."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return moe_layer_indices(model)


def from_vllm(routed_experts, tokens: int, moe_layers: Sequence[int]) -> Tensor:
    """One vLLM ``CompletionOutput.routed_experts`` -> rlflow's ``[tokens, len(moe_layers), k]`` int16.

    vLLM 0.32 (its Model Runner V2's auxiliary-output connector) returns, for each completion, the experts every
    decoder layer routed each fed token to: ``[prompt + completion - 1, decoder layers, k]`` (the last sampled token
    is never fed back), ``uint8`` (``uint16`` above 256 experts), with the rows of dense layers never written (0).
    ``tokens`` is the prompt's length plus the completion's; ``moe_layers`` the decoder-layer index of each MoE layer
    (:func:`config_moe_layers`): the result keeps those, in order, and is -1 on the tokens vLLM did not route, the
    layout :class:`RoutingRecorder` gives a completion (``Completion.extras["routed_experts"]``).
    """
    if routed_experts is None:
        raise RuntimeError("vLLM returned a completion without routed_experts (the engine must be started with "
                           "enable_return_routed_experts: VLLMEngine(return_routed_experts=True))")
    array = np.asarray(routed_experts)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"vLLM routed_experts: expected integer [tokens, decoder layers, k], got {array.dtype} "
                         f"{list(array.shape)}")
    if not tokens - 1 <= array.shape[0] <= tokens:
        raise ValueError(f"vLLM routed_experts has {array.shape[0]} token rows for a prompt and completion of {tokens} "
                         f"tokens (expected {tokens - 1}: every token but the last)")
    if moe_layers and max(moe_layers) >= array.shape[1]:
        raise ValueError(f"vLLM routed_experts has {array.shape[1]} layers; the model's MoE layers are "
                         f"{list(moe_layers)}")
    if array.size and int(array.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"vLLM routed_experts holds expert {int(array.max())}, beyond rlflow's int16 layout")
    out = torch.full((tokens, len(moe_layers), array.shape[2]), -1, dtype=torch.int16)
    out[: array.shape[0]] = torch.from_numpy(array[:, list(moe_layers)].astype(np.int16))
    return out


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
