"""Xiaomi MiMo (``model_type: mimo``): a Qwen2 decoder plus multi-token prediction (MTP) layers.

MiMo's checkpoints (XiaomiMiMo/MiMo-7B-*) ship their model code as remote code; their config is a Qwen2 config
with ``num_nextn_predict_layers`` MTP layers, whose weights sit in the safetensors under
``model.mtp_layers.{k}.``: ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` (``2H -> H`` over
``[hidden states, token embeddings]``), a Qwen2 decoder layer (``input_layernorm``, ``self_attn.*``,
``post_attention_layernorm``, ``mlp.*``) and ``final_layernorm``; the model's ``lm_head`` reads their output.

:func:`register` teaches transformers the ``mimo`` type without the remote code: the body loads as Qwen2 (the MTP
layers do not take part in the next-token forward, and transformers leaves their tensors on disk). The Megatron
strategy reads them from the folder (:func:`mtp_weights`) into megatron-core's MTP block
(``rlflow.strategies.megatron.mtp``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPE = "mimo"
MTP_PREFIX = "model.mtp_layers."
_registered: list = []


def register() -> None:
    """Register ``mimo`` with transformers' auto classes (once per process): the Qwen2 body, MTP weights skipped."""
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    class MiMoConfig(Qwen2Config):
        model_type = MODEL_TYPE

        def __init__(self, num_nextn_predict_layers: int = 0, **kwargs):
            self.num_nextn_predict_layers = num_nextn_predict_layers
            super().__init__(**kwargs)

    class MiMoForCausalLM(Qwen2ForCausalLM):
        config_class = MiMoConfig
        _keys_to_ignore_on_load_unexpected = [r"model\.mtp_layers\."]

    try:
        AutoConfig.register(MODEL_TYPE, MiMoConfig)
        AutoModelForCausalLM.register(MiMoConfig, MiMoForCausalLM)
    except ValueError:  # transformers knows mimo already (a later release): use its classes
        pass
    _registered.append((MiMoConfig, MiMoForCausalLM))


def mtp_layer_count(config) -> int:
    """The MTP layers a config declares (``num_nextn_predict_layers``; 0 for a model without them)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def mtp_weights(folder: str | Path) -> dict[str, Tensor]:
    """The ``model.mtp_layers.*`` tensors of a checkpoint folder's safetensors (sharded or not)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({f for name, f in json.loads(index.read_text())["weight_map"].items()
                        if name.startswith(MTP_PREFIX)})
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    out: dict[str, Tensor] = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(MTP_PREFIX)})
    if not out:
        raise FileNotFoundError(f"{folder}: no {MTP_PREFIX}* tensors in its safetensors, though its config declares "
                                "MTP layers (num_nextn_predict_layers)")
    return out


def save_tiny_mimo(folder: str | Path, body, mtp_layers: int = 1, seed: int = 0) -> Path:
    """A MiMo-shaped checkpoint built in code (tests, the verl-example harness): the Qwen2 model ``body`` saved with
    ``model_type: mimo`` and ``num_nextn_predict_layers``, then random MTP layers added to its safetensors under MiMo's
    names (norm weights near 1, projections of the body's scale)."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    body.save_pretrained(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update(model_type=MODEL_TYPE, architectures=["MiMoForCausalLM"], num_nextn_predict_layers=mtp_layers)
    config_file.write_text(json.dumps(config, indent=2))
    weights = folder / "model.safetensors"
    state, H = load_file(weights), body.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    layer = {k.removeprefix("model.layers.0."): v for k, v in state.items() if k.startswith("model.layers.0.")}
    for k in range(mtp_layers):
        norms = ("token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight")
        shapes = layer | {n: torch.empty(H) for n in norms} | {"input_proj.weight": torch.empty(H, 2 * H)}
        for name, like in shapes.items():
            noise = torch.randn(like.shape, generator=generator, dtype=torch.float32)
            value = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise
            state[f"{MTP_PREFIX}{k}.{name}"] = value.to(like.dtype).contiguous()
    save_file(state, weights, metadata={"format": "pt"})
    return folder


def add_mtp_weights(folder: str | Path, tensors: dict[str, Tensor]) -> None:
    """Write MTP tensors beside a saved model's safetensors: a shard of their own, listed in the index (made when the
    model was saved as one file), so the folder loads as MiMo's does."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder, shard = Path(folder), "model-mtp.safetensors"
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / shard, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index_file.write_text(json.dumps(index, indent=2))
