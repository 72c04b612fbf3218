"""Run on ranks forked by test_megatron.py (``forked.py``), by torchrun for the GPU tests, and in-process for
the one-process references:

    python -m torch.distributed.run --nproc_per_node N worker.py OUT SCENARIO [SCENARIO ...]

Each scenario writes ``OUT/<scenario>.pt`` on rank 0. Several run in one launch because starting ranks costs
more than most scenarios. Scenarios:

- ``convert``: Qwen2 (tied, q/k/v bias), Qwen3 (q/k norms) and Llama (untied) built in code, converted at
  the launch's tensor parallel size: logits (gathered for the check only), log-probs, entropy, the log-probs of
  a distillation teacher's top-k tokens, and the gradients of a loss of the three against transformers'. ``convert_pp``: the same at pipeline parallel 2
  (log-probs, entropy and every stage's gradients).
- ``train_tp``, ``train_pp``: a few GRPO steps (per-prompt seeded sampling, a KL and an entropy term,
  two optimizer steps per RL step) under tensor / pipeline parallel 2 (the launch's size); metrics and
  the full weights after every step. ``train_tp`` checkpoints every step.
- ``resume_pp``: pipeline parallel 2 resumes the ``train_tp`` run's step-1 checkpoint (written at tensor
  parallel 2) and trains to step 3; ``refuse``: loading that checkpoint into another model fails clearly.
- ``moe_ep``: a Qwen3-MoE-shaped model, expert parallel 2.
- ``critic_pp``: PPO with a critic at pipeline parallel 2; ``reward_model_tp``: a reward model scores the
  samples at tensor parallel 2 (held whole on every rank).
- ``train_tp_dp``: tensor parallel 2 x data parallel 2 (4 processes).
- ``dist_ckpt``: a Megatron dist checkpoint (verl's ``use_dist_checkpointing``) written at tensor parallel 2, loaded
  at pipeline parallel 2 and tensor parallel 1; a Trainer starting from it; another model's refused.

LoRA and routing-replay scenarios are in ``lora_scenarios.py`` (registered here when test_lora.py or
test_router_replay.py imports it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlflow import GAE, GRPO, Critic, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, ValueLoss
from rlflow.data import keys as K
from rlflow.models.logprobs import TokenLogProbs
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from rlflow.rollout.wrapper import cat_batches
from rlflow.tasks.addition import AdditionTask
from rlflow import Batching, Hardware, Loop, Optim, RunDir

STEPS = 3


def varied(solution_str: str, ground_truth: str) -> float:
    """A score that differs between a prompt's samples (so GRPO's advantages are not 0)."""
    return (len(set(solution_str)) + sum(c.isdigit() for c in solution_str) + int(ground_truth[-1]) / 3) / 8


class SeededSampling(HFRollout):
    """Samples each prompt with the RNG seeded from the prompt's tokens: the same samples whatever the
    number of processes and however the prompts are split over them."""

    def forward(self, batch):
        parts = []
        for i in range(batch.batch_size[0]):
            row = batch[i : i + 1]
            ids = row[K.PROMPT_IDS][0]
            torch.manual_seed(int((ids * torch.arange(1, ids.numel() + 1, device=ids.device)).sum()))
            part = super().forward(row)
            part[K.GROUP] = torch.full_like(part[K.GROUP], i)
            parts.append(part)
        return cat_batches(parts, self.tokenizer.pad_token_id)


def tiny_model(kind: str = "qwen2", seed: int = 0):
    """Tiny decoders built from a config in code (hidden 64, 4 heads, 2 key/value heads, 2 layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM

    vocab = len(char_tokenizer())
    if kind == "qwen2":
        return tiny_qwen2(vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                          seed=seed)
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(head_dim=16, rope_theta=5e5, **common))
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, norm_topk_prob=True, **common))
        with torch.no_grad():  # distinct router scores (transformers starts them at 0: ties)
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
        return model
    if kind in ("qwen3_5", "qwen3_5_moe"):
        from .qwen3_5_scenarios import tiny_qwen3_5

        return tiny_qwen3_5(common, seed, moe=kind == "qwen3_5_moe")
    raise ValueError(kind)


def reward_model(tok):
    """A tiny sequence-classification reward model (a third model, never trained)."""
    from rlflow.models.tiny import tiny_qwen2_reward_model
    from rlflow.rewards import ModelReward

    model = tiny_qwen2_reward_model(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64, seed=5)
    return ModelReward(model, micro_batch_size=3)


def lora_config(**kw):
    """PEFT adapters on a subset of each fused Megatron layer's parts (k and gate left out) and on both row-parallel
    layers."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], **kw)


def build(out, strategy, steps=STEPS, resume=None, devices=1, kind="qwen2", save=False, mini_batches=2, critic=False,
          accelerator="cpu", rm=False, lora=False, critic_lora=False, routing=False):
    """A GRPO Trainer on the addition task. ``mini_batches`` per RL step: with data parallelism a mini-batch is
    the union of every rank's k-th slice, so runs are only comparable across data-parallel sizes with 1.
    ``critic``: PPO with GAE and a critic (a second tiny model) instead of GRPO. ``rm``: a reward model scores.
    ``routing``: the rollout records the MoE experts it routes each token to (R3)."""
    model = tiny_model(kind)
    tok = char_tokenizer()
    train, _, _ = AdditionTask().splits()
    record = Record()
    trainer = Trainer(
        policy=Policy(model, tok, lora=lora_config() if lora else None), rollout=SeededSampling(n=4, max_new_tokens=5, temperature=1.0,
                                                                                      return_routed_experts=routing),
        reward=reward_model(tok) if rm else FunctionReward(varied),
        estimator=GAE(gamma=1.0, lam=0.95) if critic else GRPO(),
        loss=PPOLoss(kl_coef=0.05, entropy_coef=0.01),
        critic=Critic(tiny_model(kind, seed=1), lora=lora_config() if critic_lora else None) if critic else None, value_loss=ValueLoss() if critic else None,
        callbacks=[record],
        optim=Optim(lr=3e-3, critic_lr=3e-3),
        batching=Batching(batch_size=4, mini_batch_size=4 // mini_batches, micro_batch_size=2),
        loop=Loop(max_steps=steps, seed=0, progress=False),
        run=RunDir(path=out, save_every=1 if save else 0, resume=resume, loggers=()),
        hardware=Hardware(accelerator=accelerator, devices=devices, strategy=strategy),
    )
    return trainer, PromptData(train[:32], seed=0), record


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """The policy's weights in transformers' naming, gathered (collective under Megatron)."""
    from rlflow.models.policy import lora_module
    from rlflow.rollout.weight_sync import full_weight_buckets

    model, lora = trainer.policy.model, lora_module(trainer.policy.model)
    # a LoRA policy's are merged (W + s B A), as its engine receives them
    buckets = lora.merged_weight_buckets(model, 2**16) if lora else full_weight_buckets(model, 2**16)
    return {n: t.clone() for bucket in buckets for n, t in bucket}


class Record:
    """Metrics and full weights after every step, and how far the generation engine's copy is from them."""

    def __init__(self):
        self.steps = {}

    def on_step_end(self, trainer, step, metrics):
        weights = full_weights(trainer)
        engine = dict(trainer.rollout.model.named_parameters(remove_duplicate=False))
        synced = 0.0 if trainer.rollout.model is trainer.policy.model else \
            max((engine[n].detach() - w).abs().max().item() for n, w in weights.items())  # else: it generates itself
        if trainer.fabric.global_rank == 0:
            self.steps[step] = {"metrics": metrics, "weights": weights, "engine_diff": synced}


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def run_training(out: Path, strategy, **kw) -> dict:
    trainer, data, record = build(str(out), strategy, devices=world_size(), **kw)
    trainer.fit(data)
    return record.steps


# ---------------------------------------------------------------- scenarios
def convert(out: Path, accelerator: str = "cpu", layer_spec: str = "local", pipeline: bool = False,
            kinds=("qwen2", "qwen3", "llama"), **layout) -> dict:
    """Logits, log-probs, entropy and gradients of converted models against transformers' (tensor parallel =
    the launch's size; ``pipeline``: pipeline parallel instead, without the logits check: the output layer
    lives on the last stage only; or ``layout``), the weights the engines would receive, and padding removal's
    zeros."""
    import lightning_fabric as L

    from rlflow.strategies.megatron import MegatronStrategy

    world = world_size()
    layout = layout or (dict(pipeline_parallel=world) if pipeline else dict(tensor_parallel=world))
    fabric = L.Fabric(accelerator=accelerator, devices=world,
                      strategy=MegatronStrategy(**layout, layer_spec=layer_spec))
    fabric.launch()
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, 40, (3, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = 0
    response_ids = torch.randint(3, 47, (3, 5))
    topk_ids = torch.randint(0, 47, (3, 5, 4))  # a distillation teacher's top-k (forward_kl_topk), both vocab halves
    inputs = [t.to(fabric.device) for t in (prompt_ids, prompt_mask, response_ids, torch.randn(3, 5, 6), topk_ids)]
    results = {kind: compare(fabric, kind, *inputs) for kind in kinds}
    fabric.strategy.teardown()
    return results


def convert_pp(out: Path) -> dict:
    """``convert`` at pipeline parallel 2: each stage's gradients (the tied embedding's summed over its two
    copies, on the first and the last stage) against transformers'."""
    return convert(out, pipeline=True)


def compare(fabric, kind, prompt_ids, prompt_mask, response_ids, weights, topk_ids) -> dict:
    from megatron.core import parallel_state as ps

    from rlflow.strategies.megatron.weight_buckets import gather_full
    from rlflow.strategies.megatron.grads import reduce_gradients
    from rlflow.strategies.megatron.heads import _tokens
    from rlflow.strategies.megatron.slots import lm_slots

    world = world_size()
    hf = tiny_model(kind, seed=3).to(fabric.device)
    lp, ent, topk = TokenLogProbs(hf)(prompt_ids, prompt_mask, response_ids, topk_ids=topk_ids)
    ((lp * weights[..., 0]).sum() + (ent * weights[..., 1]).sum() + (topk * weights[..., 2:]).sum()).backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(response_ids)], 1)
    with torch.no_grad():
        hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    shell = tiny_model(kind, seed=3)
    module = fabric.setup_module(TokenLogProbs(shell))
    # the weights as the engines receive them: 4 KiB buckets in transformers' names
    buckets = [[(n, t.clone()) for n, t in b] for b in shell.weight_buckets(4096)]
    exported = {n: t for b in buckets for n, t in b}
    lp2, ent2, topk2 = module(prompt_ids, prompt_mask, response_ids, topk_ids=topk_ids)
    fabric.backward((lp2 * weights[..., 0]).sum() + (ent2 * weights[..., 1]).sum() + (topk2 * weights[..., 2:]).sum())
    megatron = module._forward_module
    reduce_gradients(list(megatron.parameters()))  # the strategy's reduction, which divides by the world size
    for p in megatron.parameters():
        p.grad.mul_(world // ps.get_data_parallel_world_size())  # identical batches on the data-parallel ranks
    slots = [(s.name, s) for s in lm_slots(megatron.lm) if s.primary]  # this pipeline stage's
    grads = gather_full([s for _, s in slots], [s.read([p.grad for p in s.params]) for _, s in slots])
    # every stage's (names, largest difference), so that rank 0 reports the whole model
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, ([n for n, _ in slots],
                                    max((g - hf_grads[n]).abs().max().item() for (n, _), g in zip(slots, grads))))
    grad_check = {
        "grad": max(gap for _, gap in stages),
        "grad_scale": max(g.abs().max().item() for g in hf_grads.values()),
        "grad_names": sorted({n for names, _ in stages for n in names}) == sorted(hf_grads),
        "log_probs": (lp2 - lp).abs().max().item(), "entropy": (ent2 - ent).abs().max().item(),
        "topk_log_probs": (topk2 - topk).abs().max().item(),
    }
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return grad_check
    with torch.no_grad():  # the full logits, gathered over the vocabulary for this check only
        tokens = _tokens(megatron.lm, prompt_ids, prompt_mask, response_ids)  # real tokens first in each row
        local, _ = megatron.lm.gpt.output_layer(megatron.lm.hidden_states(tokens.ids, None),
                                                weight=megatron.lm.output_weight())  # S x B x V/tp
        parts = [torch.zeros_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, -1)[..., : hf.config.vocab_size].transpose(0, 1)
        P, R = prompt_ids.shape[1], response_ids.shape[1]
        gap = max((logits[i, j] - hf_logits[i, P - int(p) + j]).abs().max().item()
                  for i, p in enumerate(prompt_mask.sum(-1)) for j in range(int(p) + R))
    result = {
        **grad_check, "logits": gap, "logits_scale": hf_logits.abs().max().item(),
        "buckets": [(len(b), sum(t.numel() * t.element_size() for _, t in b)) for b in buckets],
        "exported_names": sorted(exported) == sorted(n for n, _ in hf.named_parameters()),
        "exported": max((exported[n] - p).abs().max().item() for n, p in hf.named_parameters()),
    }
    if kind == "qwen2":  # padding removal (verl's default): 0 after each response's end, as the packed path
        response_mask = torch.ones_like(response_ids)
        response_mask[1, 3:] = 0
        packed = TokenLogProbs(tiny_model(kind, seed=3).to(fabric.device), remove_padding=True)
        expected = torch.stack(packed(prompt_ids, prompt_mask, response_ids, response_mask), -1)
        megatron.remove_padding = True
        got = torch.stack(module(prompt_ids, prompt_mask, response_ids, response_mask), -1)
        megatron.remove_padding = False
        result["remove_padding"] = (got - expected).abs().max().item(), bool((got[1, 3:] == 0).all())
    return result


def train_tp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "tp", MegatronStrategy(tensor_parallel=2), save=True)


def reward_model_tp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "rm", MegatronStrategy(tensor_parallel=2), steps=2, rm=True)


def critic_pp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "critic", MegatronStrategy(pipeline_parallel=2), steps=2, critic=True, save=True)


def train_pp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "pp", MegatronStrategy(pipeline_parallel=2), steps=2)


def resume_pp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "tp", MegatronStrategy(pipeline_parallel=2),
                        resume=str(out / "tp/global_step_1"))


def refuse(out: Path) -> dict:
    """Loading the qwen2 checkpoint into a Llama model must fail, naming what differs."""
    from rlflow.strategies.megatron import MegatronStrategy

    trainer, _, _ = build(str(out / "refuse"), MegatronStrategy(pipeline_parallel=2), devices=world_size(),
                          kind="llama")
    from rlflow.trainer.training_state import CheckpointError

    try:
        trainer.load(out / "tp/global_step_1")
    except CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


def moe_ep(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "moe", MegatronStrategy(expert_parallel=2), steps=2, kind="qwen3_moe", mini_batches=1)


def train_tp_dp(out: Path) -> dict:
    from rlflow.strategies.megatron import MegatronStrategy

    return run_training(out / "tpdp", MegatronStrategy(tensor_parallel=2), steps=2, mini_batches=1)


def verl_entry(out: Path) -> dict:
    """``python -m rlflow.trainer.main_ppo`` with Megatron, as the seed spells it (tensor parallel 2, one step,
    checkpointed), then as verl spells it (pipeline parallel 2), resuming that checkpoint for a second step.
    ``OUT/verl`` holds the model folder and parquet files (written by the test)."""
    from rlflow.config.verl.run import main

    base = [f"data.train_files={out}/verl/train.parquet", f"actor_rollout_ref.model.path={out}/verl/model",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "data.max_prompt_length=8", "data.max_response_length=4", f"trainer.default_local_dir={out}/verl/run",
            "trainer.logger=[console]", "algorithm.adv_estimator=grpo", "trainer.save_freq=1",
            "trainer.val_before_train=false", "trainer.resume_mode=auto"]
    first = out / "verl/run/global_step_1/state.ckpt/meta.pt"
    seed = main(base + ["actor_rollout_ref.actor.tensor_model_parallel_size=2", "trainer.total_training_steps=1"])
    written = first.stat().st_mtime_ns
    verl = main(base + ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                        "trainer.total_training_steps=2"])
    return {"codes": (seed, verl), "steps": sorted(p.name for p in (out / "verl/run").glob("global_step_*")),
            "step_1_rewritten": first.stat().st_mtime_ns != written}


def gpu_te(out: Path) -> dict:
    """``convert`` on CUDA with the Transformer-Engine layer spec (float32; TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return convert(out, accelerator="cuda", layer_spec="transformer_engine")


def gpu_distopt(out: Path) -> dict:
    """A few GRPO steps on CUDA with Megatron's distributed optimizer, and with the default one."""
    from rlflow.strategies.megatron import MegatronStrategy

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ws = world_size()
    distributed = MegatronStrategy(tensor_parallel=ws, distributed_optimizer=True)
    offloaded = MegatronStrategy(tensor_parallel=ws, distributed_optimizer=True, optimizer_overrides={
        "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": True})
    return {"distributed": run_training(out / "distopt", distributed, steps=2, accelerator="cuda"),
            "offloaded": run_training(out / "offload", offloaded, steps=2, accelerator="cuda"),
            "default": run_training(out / "default", MegatronStrategy(tensor_parallel=ws), steps=2, accelerator="cuda")}


def gpu_precision(out: Path) -> dict:
    """verl's precision-aware keys on CUDA: bf16 gradients and moments through megatron-core's distributed optimizer
    (Transformer Engine's FusedAdam) and through rlflow's PrecisionAwareAdamW, and the default optimizer."""
    from rlflow.strategies.megatron import MegatronStrategy

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ws, bf16 = world_size(), {"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16",
                              "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
    distributed = MegatronStrategy(tensor_parallel=ws, distributed_optimizer=True, optimizer_overrides=bf16)
    trainer, data, record = build(str(out / "te"), distributed, steps=2, devices=ws, accelerator="cuda")
    trainer.fit(data)
    inner = trainer.optimizer.optimizer.inner  # megatron-core's optimizer
    configs = [o.config for o in getattr(inner, "chained_optimizers", [inner])]
    return {"te": record.steps, "te_dtypes": [(c.exp_avg_dtype, c.exp_avg_sq_dtype, c.main_grads_dtype) for c in configs],
            "own": run_training(out / "own", MegatronStrategy(tensor_parallel=ws, optimizer_overrides=bf16), steps=2,
                                accelerator="cuda"),
            "default": run_training(out / "default", MegatronStrategy(tensor_parallel=ws), steps=2, accelerator="cuda")}


def gpu_offload(out: Path) -> dict:
    """verl's Megatron CPU offload on CUDA: PPO (policy, reference, critic) with every role offloading, and without;
    after training (the last weight export offloads), the CUDA memory allocated and where the tensors are."""
    from rlflow.strategies.megatron import MegatronStrategy

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    offload = {"policy": ["params", "grads", "optimizer"], "reference": ["params"], "critic": ["params", "optimizer"]}
    result = {}
    for name, roles in (("offload", offload), ("plain", None)):
        strategy = MegatronStrategy(tensor_parallel=world_size(), offload=roles)
        trainer, data, record = build(str(out / name), strategy, steps=2, devices=world_size(), critic=True,
                                      accelerator="cuda")
        trainer.fit(data)
        optimizer = trainer.optimizer.optimizer
        result[name] = {"steps": record.steps, "allocated": torch.cuda.memory_allocated(),
                        "param_devices": sorted({p.device.type for p in trainer.policy.module.parameters()}),
                        "state_devices": sorted({t.device.type for s in optimizer.state.values() for t in s.values()
                                                 if t.dim() > 0}),
                        "policy_bytes": sum(p.numel() * p.element_size() for p in trainer.policy.module.parameters())}
        trainer.fabric.strategy.teardown()
        del trainer, optimizer
        torch.cuda.empty_cache()
    return result


def dist_ckpt(out: Path) -> dict:
    """A Megatron dist checkpoint (megatron-core's dist_checkpointing) written at tensor parallel 2 from one model,
    loaded at pipeline parallel 2 and at tensor parallel 1 (x data parallel 2) into another model's shell: the
    log-probs are the first model's. A Trainer whose policy and reference start from it sends those weights to its
    engine before the first rollout; a checkpoint of another architecture is refused."""
    import lightning_fabric as L

    from rlflow.strategies.megatron import MegatronStrategy, dist_checkpoint

    world, folder = world_size(), out / "dist_ckpt"
    torch.manual_seed(1)
    prompt_ids, response_ids = torch.randint(3, 40, (3, 6)), torch.randint(3, 47, (3, 5))
    prompt_mask = torch.ones_like(prompt_ids)
    source = tiny_model("qwen2", seed=3)
    with torch.no_grad():
        expected, _ = TokenLogProbs(source)(prompt_ids, prompt_mask, response_ids)

    def fabric_for(**strategy):
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=MegatronStrategy(**strategy))
        fabric.launch()
        return fabric

    fabric = fabric_for(tensor_parallel=2)
    dist_checkpoint.save(fabric.setup_module(TokenLogProbs(tiny_model("qwen2", seed=3)))._forward_module, folder)
    fabric.strategy.teardown()
    result = {"files": sorted(p.name for p in folder.iterdir())}
    for name, layout in (("pp2", {"pipeline_parallel": 2}), ("tp1", {})):
        fabric = fabric_for(**layout, dist_checkpoints={"policy": str(folder)})
        module = fabric.setup_module(TokenLogProbs(tiny_model("qwen2", seed=7)))  # other weights, replaced by the folder's
        with torch.no_grad():
            result[name] = (module(prompt_ids, prompt_mask, response_ids)[0] - expected).abs().max().item()
        if name == "tp1":  # another architecture (q/k norms the folder lacks)
            try:
                fabric.setup_module(TokenLogProbs(tiny_model("qwen3", seed=7)))
                result["refused"] = None
            except ValueError as e:
                result["refused"] = str(e)
        fabric.strategy.teardown()
    trainer, _, _ = build(str(out / "dist_trainer"), MegatronStrategy(
        tensor_parallel=2, dist_checkpoints={"policy": str(folder), "reference": str(folder)}), devices=world)
    engine = dict(trainer.rollout.model.named_parameters())
    result["engine"] = max((engine[n].detach() - p).abs().max().item() for n, p in source.named_parameters())
    with torch.no_grad():
        ref = trainer.reference.module(prompt_ids, prompt_mask, response_ids)[0]
    result["reference"] = (ref - expected).abs().max().item()
    trainer.fabric.strategy.teardown()
    return result


SCENARIOS = {f.__name__: f for f in (convert, convert_pp, train_tp, train_pp, resume_pp, refuse, moe_ep, critic_pp,
                                     reward_model_tp, train_tp_dp, verl_entry, gpu_te, gpu_distopt, gpu_precision,
                                     gpu_offload,
                                     dist_ckpt)}

def run(out: Path, names) -> None:
    """The scenarios in order; rank 0 saves each one's result as ``OUT/<name>.pt``."""
    for name in names:
        result = SCENARIOS[name](out)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
        dist.barrier()
    dist.barrier()  # gloo can abort at teardown unless every rank is done


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
