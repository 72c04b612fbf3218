"""Export a checkpoint's policy as a plain Hugging Face folder that ``from_pretrained`` loads.

    rlflow export runs/x/global_step_100 ./exported

Works for one-file checkpoints and for sharded ones (``torch.distributed.checkpoint``
folders written by FSDP2), whatever the number of ranks that wrote them. A LoRA checkpoint
(it holds the adapter, and ``lora_adapter/adapter_config.json``) is merged onto its base model:
``./exported`` is then the merged model and ``./exported/lora_adapter`` the PEFT adapter folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.models import mimo
from rlflow.trainer.training_state import latest_checkpoint

if TYPE_CHECKING:  # torch loads only once a checkpoint is known to exist: a wrong path is reported at once
    import torch

POLICY_PREFIX = "lm."  # the policy's weights sit under TokenLogProbs.lm
ADAPTER_DIR = "lora_adapter"  # rlflow.models.lora.ADAPTER_DIR (not imported: plain exports need no PEFT)


class ExportError(ValueError):
    """The folder is not a checkpoint that can be exported; the message names it and says why."""


def check_checkpoint(checkpoint: Path) -> None:
    """Fail with a message naming ``checkpoint`` unless it is a ``global_step_N`` folder of a run."""
    if not checkpoint.exists():
        raise ExportError(f"checkpoint folder {checkpoint} does not exist")
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint} is a file, not a checkpoint folder (pass RUN_DIR/global_step_N)")
    if not (checkpoint / "state.ckpt").exists():
        latest = latest_checkpoint(checkpoint)
        hint = f"; this looks like a run folder: its latest checkpoint is {latest}" if latest else ""
        raise ExportError(f"{checkpoint} is not an rlflow checkpoint: no state.ckpt{hint}")
    if not (checkpoint / "huggingface").exists():
        raise ExportError(f"{checkpoint} has no huggingface/ folder (config and tokenizer); is it an rlflow checkpoint?")


def load_policy_state(state_path: Path) -> dict[str, torch.Tensor]:
    """The policy's weights from ``state.ckpt`` (a file, or a sharded folder consolidated on the fly)."""
    import torch

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


def export_hf(checkpoint: str | Path, out_dir: str | Path, base_model: str | Path | None = None) -> Path:
    """Write ``config.json``, weights (safetensors) and the tokenizer of the checkpoint's policy to ``out_dir``.

    ``base_model``: for a LoRA checkpoint, the base model folder (default: the one its adapter config names).
    """
    checkpoint, out_dir = Path(checkpoint).expanduser(), Path(out_dir).expanduser()
    check_checkpoint(checkpoint)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    meta = checkpoint / "huggingface"
    if (checkpoint / ADAPTER_DIR / "adapter_config.json").exists():
        return export_lora(checkpoint, out_dir, base_model)
    mimo.register()  # a MiMo policy: its Qwen2 body here, its MTP layers written beside it (rlflow.models.mimo)
    config = AutoConfig.from_pretrained(meta)
    vision_language = getattr(config, "vision_config", None) is not None  # its tower's weights are the policy's too
    model = (AutoModelForImageTextToText if vision_language else AutoModelForCausalLM).from_config(config)
    try:
        weights = load_policy_state(checkpoint / "state.ckpt")
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: say which one
        raise ExportError(f"cannot read {checkpoint / 'state.ckpt'}: it may be incomplete or damaged "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from e
    mtp = {k: weights.pop(k) for k in list(weights) if k.startswith(mimo.MTP_PREFIX)}
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # shapes differ from huggingface/config.json
        raise ExportError(f"{checkpoint}: the weights do not fit huggingface/config.json "
                          f"({str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else e})") from e
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{checkpoint}: checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                          f"unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)
    if mtp:
        mimo.add_mtp_weights(out_dir, mtp)
    AutoTokenizer.from_pretrained(meta).save_pretrained(out_dir)
    return out_dir


def export_lora(checkpoint: Path, out_dir: Path, base_model: str | Path | None = None) -> Path:
    """A LoRA checkpoint -> ``out_dir`` (the merged model, tokenizer) and ``out_dir/lora_adapter`` (PEFT's folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = LoraConfig.from_pretrained(str(checkpoint / ADAPTER_DIR))
    recorded = config.base_model_name_or_path
    base = Path(str(base_model or recorded or "")).expanduser()
    if not base_model and not (recorded and (base / "config.json").exists()):
        named = (f"its base model {recorded!r} is not a local model folder" if recorded
                 else "its base model is not recorded (a policy built from an in-memory model)")
        raise ExportError(f"{checkpoint} holds a LoRA adapter; {named}: "
                          "pass the base model (rlflow export CKPT OUT --base-model DIR)")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    adapter = load_policy_state(checkpoint / "state.ckpt")
    missing, unexpected = model.load_state_dict(adapter, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ExportError(f"{checkpoint}: the adapter does not match {ADAPTER_DIR}/adapter_config.json on {base}: "
                          f"missing {sorted(trainable & set(missing))}, unexpected {unexpected}")
    model.save_pretrained(out_dir / ADAPTER_DIR)
    model.merge_and_unload().save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(checkpoint / "huggingface").save_pretrained(out_dir)
    return out_dir
