"""Export a checkpoint's policy as a plain Hugging Face folder that ``from_pretrained`` loads.

    rlflow export runs/x/checkpoints/global_step_100 ./exported

Works for one-file checkpoints and for sharded ones (``torch.distributed.checkpoint``
folders written by FSDP2), whatever the number of ranks that wrote them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

POLICY_PREFIX = "lm."  # the policy's weights sit under TokenLogProbs.lm


def load_policy_state(state_path: Path) -> dict[str, torch.Tensor]:
    """The policy's weights from ``state.ckpt`` (a file, or a sharded folder consolidated on the fly)."""
    if state_path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            single = Path(tmp) / "state.pt"
            dcp_to_torch_save(state_path, single)
            state = torch.load(single, map_location="cpu", weights_only=False)  # our own file
    else:
        state = torch.load(state_path, map_location="cpu", weights_only=False)  # our own file
    policy = state["policy"]
    return {k.removeprefix(POLICY_PREFIX): v for k, v in policy.items() if k.startswith(POLICY_PREFIX)}


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write ``config.json``, weights (safetensors) and the tokenizer of the checkpoint's policy to ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = checkpoint / "huggingface"
    if not meta.exists():
        raise FileNotFoundError(f"{checkpoint} has no huggingface/ folder (config and tokenizer); is it an rlflow checkpoint?")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta))
    missing, unexpected = model.load_state_dict(load_policy_state(checkpoint / "state.ckpt"), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(meta).save_pretrained(out_dir)
    return out_dir
