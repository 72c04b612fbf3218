"""``--dry-run``: validate config and data, then print what a run would do and stop.

Prints the component tree the run builds (as the Python a user would write: the run instantiates that tree), the data it found, the batch arithmetic
of one RL step (prompts x n -> mini-batches -> micro-batches per device), the schedule, a rough
estimate of memory and compute per step, and notes on the keys the user set; the full resolved
config follows with ``--show-config``. Loads the tokenizer and the
model's config, never its weights.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.config.verl.build import build_data, load_tokenizer, run_notes, total_steps
from rlflow.config.verl.folders import critic_config, load_vision_processor, policy_config
from rlflow.config.verl.plan import Plan
from rlflow.config.report import gib, line
from rlflow.config.components_python import python
from rlflow.config.verl.tree import verl_tree, warmup_steps
from rlflow.config.verl.megatron import dry_run_section
from rlflow.data.prompts import render_prompt

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
MAX_LENGTH_ROWS = 50_000  # prompts tokenized to measure lengths
H100_BF16 = 989e12


def count_parameters(config, lora: dict | str | None = None) -> tuple[int, object, int]:
    """Parameter count from the model's config alone (built on the meta device: no memory, no weights), the
    decoder's config (a vision-language model's text config), and the trainable count (all of them; with
    ``lora``, the adapter's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=True)  # the config was loaded as the user allowed
        n_params = sum(p.numel() for p in model.parameters())
        if lora is None:
            return n_params, config.get_text_config(), n_params
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(**lora) if isinstance(lora, dict) else LoraConfig.from_pretrained(lora)
        model = get_peft_model(model, lora_config)
    return n_params, config.get_text_config(), sum(p.numel() for p in model.parameters() if p.requires_grad)


def prompt_lengths(data, tokenizer) -> list[int]:
    rows = data.train[:MAX_LENGTH_ROWS]
    return [data.prompt_length(r, tokenizer) for r in rows]  # image tokens included for vision-language rows


TREE = ("Objects: this command's component tree, as the Python a user would write; the run builds this tree "
        "(rlflow.config.verl.tree):")


def objects_section(plan: Plan, total: int) -> list[str]:
    """The tree the verl keys translate into, printed as Python; the parts it does not say yet are listed."""
    made = verl_tree(plan, total)
    out = [TREE, "", python(made.tree).rstrip()]
    if made.deferred:
        out += ["", "Not said by the tree yet (the run passes these objects as they are, or, for the data, loads "
                    "them as rlflow.config.verl.build.build_data does):"]
        out += [f"  - {d}" for d in made.deferred]
    return out


def batch_section(plan: Plan) -> list[str]:
    t, procs = plan.trainer_kwargs, plan.devices.processes
    n, bs, mini, epochs = plan.rollout_kwargs["n"], t["batch_size"], t["mini_batch_size"], t["ppo_epochs"]
    traj, mini_traj = bs * n, mini * n
    replica = getattr(plan.devices.strategy, "model_parallel_size", 1)  # Megatron: ranks that share a batch
    per_dev = mini_traj // (procs // replica)
    micro = t["micro_batch_size"] or per_dev
    lp_micro, lp_tokens = plan.policy_kwargs["micro_batch_size"], plan.policy_kwargs.get("max_tokens_per_micro_batch")
    return [
        "Batch arithmetic of one RL step (verl units: mini-batches count prompts, micro-batches trajectories)",
        line("prompts per step", "data.train_batch_size", f"{bs}"),
        line("samples per prompt", f"{R}.n", f"{n}"),
        line("trajectories per step", f"{bs} prompts x {n} samples", f"{traj}"),
        line("mini-batches per step", f"train_batch_size / ppo_mini_batch_size = {bs} / {mini}",
             f"{bs // mini} mini-batches"),
        line("optimizer steps per step", f"{bs // mini} mini-batches x ppo_epochs {epochs}", f"{bs // mini * epochs}"),
        line("trajectories per mini-batch", f"ppo_mini_batch_size x n = {mini} x {n}", f"{mini_traj}"),
        line("per device", f"{mini_traj} trajectories / {procs} process(es)", f"{per_dev}") if replica == 1 else
        line("per model replica", f"{mini_traj} trajectories / {procs // replica} data-parallel replicas",
             f"{per_dev}"),
        line("micro-batch per device", f"{A}.ppo_micro_batch_size_per_gpu",
             f"{micro} trajectories" + ("" if t["micro_batch_size"] else " (unset: the whole mini-batch)")),
        line("grad. accumulation", f"{per_dev} / {micro}", f"{-(-per_dev // micro)} forward/backward passes per "
                                                           "optimizer step"),
        line("log-prob micro-batch", f"{R}.log_prob_micro_batch_size_per_gpu",
             f"{lp_micro or traj} trajectories" + ("" if lp_micro else " (unset: the whole batch)"))
        if not lp_tokens else
        line("log-prob micro-batch", f"{R}.log_prob_max_token_len_per_gpu (log_prob_use_dynamic_bsz)",
             f"<= {lp_tokens} tokens (rows grouped by length)"),
    ]


def schedule_section(plan: Plan, data, total: int) -> list[str]:
    t, bs = plan.trainer_kwargs, plan.trainer_kwargs["batch_size"]
    per_epoch, left = len(data.train) // bs, len(data.train) % bs
    how = ("trainer.total_training_steps" if plan.total_training_steps
           else f"total_epochs x steps per epoch = {plan.total_epochs} x {per_epoch}")
    val = ("never (no data.val_files)" if not data.val else
           (f"every {t['val_every']} steps and at the last" if t["val_every"] else "only before training")
           + (", and before training" if plan.val_before_train and t["val_every"] else ""))
    if data.val and not plan.val_before_train and not t["val_every"]:
        val = "never (trainer.test_freq=-1, trainer.val_before_train=False)"
    ckpt = (f"every {t['save_every']} steps and at the last, in {t['run_dir']}/global_step_N"
            if t["save_every"] else "never (trainer.save_freq=-1)")
    return ["Schedule",
            line("training prompts", str(data.train_name)[:50], f"{len(data.train)}"),
            line("steps per epoch", f"{len(data.train)} // {bs} (a last partial batch is skipped)",
                 f"{per_epoch} ({left} prompts unused per epoch)"),
            line("total RL steps", how, f"{total}"),
            line("lr warm-up", f"{A}.optim.lr_warmup_steps(_ratio)", f"{warmup_steps(plan, total)} steps, then "
                                                                       f"{t['lr_schedule']}"),
            f"  validation: {val}; resume: {t['resume'] or 'disabled'}", f"  checkpoints: {ckpt}"]


def data_section(plan: Plan, data, lengths: list[int], problems: list[str]) -> list[str]:
    sources: dict[str, int] = {}
    for r in data.train:
        sources[r["data_source"]] = sources.get(r["data_source"], 0) + 1
    limit = data.max_prompt_length
    over = sum(x > limit for x in lengths) if limit else 0
    sampled = f" (first {len(lengths)})" if len(lengths) < len(data.train) else ""
    if over and data.truncation == "error":
        problems.append(f"{over} training prompt(s){sampled} are longer than data.max_prompt_length={limit} tokens "
                        "and data.truncation=error: the run would stop at the first batch holding one. Set "
                        "data.filter_overlong_prompts=True, or data.truncation=left|right|middle")
    return ["Data",
            f"  train: {len(data.train)} prompts in {data.train_name}; validation: {len(data.val)} prompts"
            f"{' in ' + data.val_name if data.val else ''}",
            f"  data sources: {', '.join(f'{k} ({v})' for k, v in sources.items())}",
            f"  prompt tokens{sampled}: max {max(lengths)}, mean {sum(lengths) / len(lengths):.1f}; "
            f"{over} over max_prompt_length={limit} (truncation={data.truncation})"]


def cost_section(plan: Plan, total: int, longest_prompt: int) -> list[str]:
    n_params, config, n_train = count_parameters(policy_config(plan), plan.lora)
    n_critic = count_parameters(critic_config(plan))[0] if plan.critic_path else 0
    t = plan.trainer_kwargs
    act = 2 if "bf16" in t["precision"] or "16" in t["precision"] else 4
    P = min(plan.data_kwargs["max_prompt_length"] or longest_prompt, longest_prompt)
    Rl = plan.rollout_kwargs["max_new_tokens"]
    traj = t["batch_size"] * plan.rollout_kwargs["n"]
    micro = t["micro_batch_size"] or t["mini_batch_size"] * plan.rollout_kwargs["n"]
    config = getattr(config, "text_config", None) or config  # a vision-language model: its language model's shape
    layers, hidden = config.num_hidden_layers, config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    ref = plan.loss_kwargs.get("kl_coef", 0) > 0 or plan.kl_controller is not None
    # fp32 weights 4 B/param; gradients and AdamW's two moments 12 B per trainable one; the reference: a frozen
    # copy, or nothing with LoRA (the adapter is switched off)
    frozen_ref = ref and plan.lora is None
    states = 4 * n_params + 12 * n_train + (4 * n_params if frozen_ref else 0) + 16 * n_critic
    kv = 2 * layers * kv_heads * head_dim * act * traj * (P + Rl)
    ckpt = plan.policy_kwargs["gradient_checkpointing"]
    per_layer = micro * (P + Rl) * hidden * act * (1 if ckpt else 16)
    activations = layers * per_layer + 3 * 4096 * config.vocab_size * 4
    T = traj * (P + Rl)
    updates = (8 if ckpt else 6) * plan.trainer_kwargs["ppo_epochs"]
    needs_old = t["ppo_epochs"] > 1 or t["mini_batch_size"] < t["batch_size"]
    flops = 2 * n_params * T * (1 + ref + needs_old) + updates * n_params * T + (2 + updates) * n_critic * T
    return [f"Estimate per step (upper bound: every prompt {P} tokens, the longest in the data, + every response "
            f"{Rl}; precision {t['precision']})",
            f"  parameters: policy {n_params / 1e6:.2f} M"
            + (f" (LoRA: {n_train / 1e6:.3g} M trainable, {100 * n_train / n_params:.2g}%)" if plan.lora else "")
            + (f", critic {n_critic / 1e6:.2f} M" if n_critic else ""),
            f"  memory: weights + grads + AdamW {gib(states)} (fp32 master: 4 B/param + 12 B/trainable param"
            f"{', + frozen reference 4 B/param' if frozen_ref else ''}"
            f"{'; the reference is the model with its adapter off' if ref and plan.lora else ''}); "
            f"KV cache for {traj} sequences {gib(kv)}; "
            f"activations per micro-batch of {micro} ~{gib(activations)}"
            f" ({'with' if ckpt else 'without'} gradient checkpointing); peak ~{gib(states + max(kv, activations))}",
            f"  compute: ~{flops / 1e12:.3g} TFLOP per step, ~{flops * total / 1e15:.3g} PFLOP for {total} steps"
            + (f" (~{flops / (0.4 * H100_BF16 * plan.devices.processes):.3g} s/step at 40% of the bf16 peak of "
               f"{plan.devices.processes} H100(s); generation is memory-bound and usually slower)"
               if plan.devices.accelerator == "cuda" else "")]


def dry_run(plan: Plan, show_config: bool = False) -> tuple[str, list[str]]:
    """The report and its problems (a problem makes the dry run exit non-zero).

    The summary comes first; the full resolved config (~300 lines of verl keys) only with ``show_config``.
    """
    tokenizer = load_tokenizer(plan)
    data = build_data(plan, tokenizer, load_vision_processor(plan))
    total = total_steps(plan, data)
    problems: list[str] = []
    lengths = prompt_lengths(data, tokenizer)
    sections = [objects_section(plan, total), data_section(plan, data, lengths, problems), batch_section(plan),
                schedule_section(plan, data, total), cost_section(plan, total, max(lengths))]
    if hasattr(plan.devices.strategy, "layout"):  # Megatron: layout and memory per rank
        config = policy_config(plan)
        prompt = min(plan.data_kwargs["max_prompt_length"] or max(lengths), max(lengths))
        sections.append(dry_run_section(plan, config, prompt + plan.rollout_kwargs["max_new_tokens"]))
    notes = run_notes(plan, data)
    if notes:
        sections.append(["Notes"] + [f"  - {n}" for n in notes])
    if problems:
        sections.append(["PROBLEMS"] + [f"  - {p}" for p in problems])
    if show_config:
        sections.append(["Resolved config (every verl key)", plan.cfg.to_yaml()])
    sections.append([f"Dry run: {'config and data are valid' if not problems else 'problems found'}; "
                     f"nothing was trained. Run without --dry-run to train ({Path.cwd()})"
                     + ("." if show_config else "; add --show-config to print the whole resolved config.")])
    return "\n\n".join("\n".join(s) for s in sections), problems
