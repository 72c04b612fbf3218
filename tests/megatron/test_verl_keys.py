"""The Megatron keys of the verl entry point, the 70B dry run, the layout checks and the memory estimate.

Nothing here starts megatron-core (these run without it installed).
"""

import importlib.util
import re

import pandas as pd
import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from rlflow.config.verl.loading import ConfigError, NotSupportedError, load_config
from rlflow.config.verl.plan import make_plan
from rlflow.config.verl.run import main
from rlflow.models.tiny import char_tokenizer
from rlflow.strategies import MegatronStrategy, resolve_strategy
from rlflow.strategies.megatron import ParallelLayout
from rlflow.strategies.megatron.memory import layer_parameters, lora_parameters, rank_memory

from ..config.conftest import CHAT_TEMPLATE, verl_rows

A = "actor_rollout_ref.actor"
BASE = ["actor_rollout_ref.model.path=/nowhere", "algorithm.adv_estimator=grpo", "trainer.device=cpu",
        "trainer.logger=[console]"]


def plan(*overrides):
    return make_plan(load_config(BASE + list(overrides)))


def test_seed_and_verl_spellings_give_the_same_strategy():
    seed = plan(f"{A}.strategy=megatron", f"{A}.tensor_model_parallel_size=2", f"{A}.pipeline_model_parallel_size=2",
                "trainer.n_gpus_per_node=8")
    verl = plan(f"{A}.strategy=megatron", f"{A}.megatron.tensor_model_parallel_size=2",
                f"{A}.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=8")
    backend = plan("actor_rollout_ref.model.backend=megatron", f"{A}.tensor_model_parallel_size=2",
                   f"{A}.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=8")
    for p in (seed, verl, backend):
        strategy = p.trainer_kwargs["strategy"]
        assert isinstance(strategy, MegatronStrategy)
        assert (strategy.layout.tensor, strategy.layout.pipeline, strategy.model_parallel_size) == (2, 2, 4)
        assert p.devices.processes == 8 and p.trainer_kwargs["devices"] == 8 and p.devices.accelerator == "cpu"
        assert p.trainer_kwargs["sequence_parallel_size"] == 1  # the Trainer derives the replica groups itself
    notes = "\n".join(seed.notes)
    assert "sequence_parallel=True (verl's default) is off" in notes
    assert "use_distributed_optimizer=True (verl's default)" in notes
    assert "enable_gradient_checkpointing=True is off under Megatron on CPU" in notes
    assert plan(f"{A}.strategy=megatron", f"{A}.megatron.expert_model_parallel_size=2", f"{A}.megatron.seed=7",
                "trainer.n_gpus_per_node=2").trainer_kwargs["strategy"].layout.expert == 2


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.tensor_model_parallel_size=2", f"{A}.megatron.tensor_model_parallel_size=4"], "disagree; set only one"),
    ([f"{A}.megatron.tensor_model_parallel_size=3"], "needs a multiple of 3 processes"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4", f"{A}.megatron.tensor_model_parallel_size=2"],
     "rlflow trains every role with one Megatron layout"),
    ([f"{A}.megatron.virtual_pipeline_model_parallel_size=2", f"{A}.megatron.pipeline_model_parallel_size=2"],
     "interleaved pipeline stages are not supported"),
    ([f"{A}.megatron.expert_tensor_parallel_size=2"], "keeps each expert whole"),
    (["actor_rollout_ref.model.backend=megatron", f"{A}.strategy=fsdp"],
     "set actor_rollout_ref.actor.strategy=megatron"),
    (["algorithm.adv_estimator=gae", "critic.strategy=fsdp", "critic.model.path=/nowhere"],
     "rlflow trains every role with one strategy"),
])
def test_inconsistent_megatron_keys_are_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(f"{A}.strategy=megatron", "trainer.n_gpus_per_node=4", *overrides)


def test_model_parallel_sizes_without_megatron_and_unsupported_keys_are_errors():
    with pytest.raises(ConfigError, match="needs actor_rollout_ref.actor.strategy=megatron"):
        plan(f"{A}.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2")
    with pytest.raises(NotSupportedError, match="context parallelism without Transformer Engine"):
        plan(f"{A}.strategy=megatron", f"{A}.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2")
    with pytest.raises(NotSupportedError, match="names no backend of rlflow"):
        plan(f"{A}.strategy=deepspeed")
    # verl's recomputation keys pass through on GPUs; on CPU they are dropped with a note
    p = plan(f"{A}.strategy=megatron", f"+{A}.megatron.override_transformer_config.recompute_granularity=full")
    assert p.trainer_kwargs["strategy"].transformer_overrides == {}
    assert any("not applied on CPU" in n for n in p.notes)


def test_strategy_names_and_layout_checks():
    assert isinstance(resolve_strategy("megatron"), MegatronStrategy)
    with pytest.raises(ValueError, match="needs layer_spec='transformer_engine'"):
        MegatronStrategy(tensor_parallel=2, sequence_parallel=True)
    layout = ParallelLayout(tensor=2, pipeline=2)
    assert layout.data_parallel(8) == 2 and layout.describe(8) == "TP 2 x PP 2 x DP 2 (8 processes)"
    config = Qwen2Config(num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=3)
    with pytest.raises(ValueError, match="key/value heads 3 not divisible by 2.*layers 3 not divisible by 2"):
        layout.check_model(config)
    with pytest.raises(ValueError, match="needs an MoE model"):
        ParallelLayout(expert=2).check_model(Qwen2Config(num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.parametrize("config", [
    Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2),
    Qwen3Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2),
    Qwen3MoeConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
], ids=lambda c: c.model_type)
def test_parameter_counts_equal_the_models(config):
    model = AutoModelForCausalLM.from_config(config)
    layer = layer_parameters(config)
    assert layer.split + layer.whole + layer.experts == sum(p.numel() for p in model.model.layers[0].parameters())
    total = rank_memory(config, ParallelLayout(), 1, micro_batch=1, seq_len=8).total_parameters
    assert total == sum(p.numel() for p in model.parameters())


def test_memory_per_rank_of_a_70b_layout():
    """Llama-3-70B shapes at TP 8 x PP 2 x DP 2: the last stage (40 layers, norm, untied head) is the largest."""
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    H, I, V = 8192, 28672, 128256
    split = 2 * H * H + 2 * H * 1024 + 3 * H * I  # q, o; k, v (8 heads of 128); gate, up, down
    last_stage = 40 * (split // 8 + 2 * H) + H + V * H // 8
    mem = rank_memory(config, ParallelLayout(tensor=8, pipeline=2), 32, micro_batch=2, seq_len=1024)
    assert mem.parameters == last_stage
    assert mem.model_states == 16 * last_stage and mem.distributed_optimizer == (4 + 12 // 2) * last_stage
    s, b, a = 1024, 2, 64
    activations = 40 * s * b * H * (10 + 24 / 8 + 5 * a * s / (H * 8)) + 3 * 2048 * (V // 8) * 4
    assert mem.activations == int(activations)


@pytest.fixture
def seventy_b(tmp_path):
    """The seed's 70B snippet (verbatim but for model.path), a 70B-shaped Llama config (no weights) and prompts."""
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp_path / "model")
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False).save_pretrained(tmp_path / "model")
    pd.DataFrame(verl_rows(2048, "train", 0)).to_parquet(tmp_path / "train.parquet")
    (tmp_path / "snippet.yaml").write_text("""actor_rollout_ref:
  model:
    path: /path/to/megatron/checkpoint
    backend: megatron
  actor:
    strategy: megatron
    tensor_model_parallel_size: 8
    pipeline_model_parallel_size: 2
  rollout:
    name: vllm
    tensor_parallel_size: 8
""")
    return tmp_path


def test_seed_70b_snippet_dry_runs_with_parallel_arithmetic(seventy_b, capsys):
    # the snippet's launch (4 nodes x 8) as CPU processes; GRPO (no critic model given). The vLLM engine is the
    # engines issue's: here generation is transformers' (rollout.tensor_parallel_size then gets a note)
    argv = ["--config-path", str(seventy_b), "--config-name", "snippet", "--dry-run",
            f"actor_rollout_ref.model.path={seventy_b}/model", f"data.train_files={seventy_b}/train.parquet",
            "trainer.nnodes=4", "trainer.n_gpus_per_node=8", "trainer.device=cpu", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.name=hf", f"trainer.default_local_dir={seventy_b}/run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Not said by the tree yet" not in out
    expected = [r"hardware=Hardware\(.*strategy=MegatronStrategy\(tensor_parallel=8, pipeline_parallel=2[,)]",  # a node
                r"Megatron: TP 8 x PP 2 x DP 2 \(32 processes\)",
                r"replicas \(data parallel\)\s+32 processes / \(TP 8 x CP 1 x PP 2\)\s+= 2",
                r"layers per stage\s+80 layers / PP 2\s+= 40",
                r"per model replica\s+256 trajectories / 2 data-parallel replicas\s+= 128",
                r"parameters per rank .*= 4.41 B of 70.6 B",
                r"weights\+grads\+AdamW / rank\s+16 B/param .*= 65.72 GiB",
                r"peak per rank \(training\)", r"HFRollout engine holds 262.83 GiB",
                r"rollout.tensor_parallel_size=8 has no effect", r"Dry run: config and data are valid"]
    for pattern in expected:
        assert re.search(pattern, out), pattern
    assert not (seventy_b / "run").exists()


def test_dist_checkpoint_keys_name_the_folders_each_role_starts_from(tmp_path):
    """verl's use_dist_checkpointing + dist_checkpointing_path (actor, ref, critic) -> MegatronStrategy's
    dist_checkpoints (tests/megatron/test_megatron.py loads one); the folder is checked before anything runs."""
    folder = tmp_path / "mcore"
    folder.mkdir()
    (folder / "metadata.json").write_text("{}")
    R = "actor_rollout_ref.ref.megatron"
    both = [f"{A}.strategy=megatron", f"{A}.megatron.use_dist_checkpointing=True",
            f"{A}.megatron.dist_checkpointing_path={folder}", f"{R}.use_dist_checkpointing=True",
            f"{R}.dist_checkpointing_path={folder}"]
    p = plan(*both)
    strategy = p.trainer_kwargs["strategy"]
    assert strategy.dist_checkpoints == {"policy": str(folder), "reference": str(folder)}
    assert f"dist_checkpoints={strategy.dist_checkpoints!r}" in repr(strategy)
    notes = "\n".join(p.notes)
    assert "start from Megatron dist checkpoints" in notes and "has no effect in rlflow" not in notes
    # the reference alone keeps the Hugging Face weights unless its own key is set; a path alone does nothing (verl)
    p = plan(f"{A}.strategy=megatron", f"{A}.megatron.use_dist_checkpointing=True",
             f"{A}.megatron.dist_checkpointing_path={folder}", f"{R}.dist_checkpointing_path={folder}")
    assert p.trainer_kwargs["strategy"].dist_checkpoints == {"policy": str(folder)}
    assert f"{R}.dist_checkpointing_path='{folder}' has no effect without" in "\n".join(p.notes)
    (tmp_path / "hf").mkdir()
    for overrides, message in [
        ([f"{A}.megatron.use_dist_checkpointing=True"], "needs actor_rollout_ref.actor.megatron.dist_checkpointing_path"),
        ([f"{A}.megatron.use_dist_checkpointing=True", f"{A}.megatron.dist_checkpointing_path={tmp_path}/none"],
         "dist_checkpointing_path='.*none': no such folder"),
        ([f"{A}.megatron.use_dist_checkpointing=True", f"{A}.megatron.dist_checkpointing_path={tmp_path}/hf"],
         "is not a Megatron dist checkpoint"),
        (both + [f"{R}.dist_checkpointing_prefix=module."], "with one key prefix"),
    ]:
        with pytest.raises(ConfigError, match=message):
            plan(f"{A}.strategy=megatron", *overrides)


def test_router_replay_r2_and_r3_are_the_strategys_and_r3_takes_the_routing_from_an_hf_rollout():
    """verl's megatron.router_replay.mode: R2 turns on MegatronStrategy(router_replay="R2"); R3 with the rollout's
    enable_rollout_routing_replay (as verl's scripts set both) turns on router_replay="R3" and an HFRollout that
    records the routed experts (tests/megatron/test_router_replay.py runs both). vLLM cannot return them here:
    refused, saying why; R3 without the rollout's recording is an error naming the key to set."""
    RR, ROLL = f"{A}.megatron.router_replay", "actor_rollout_ref.rollout"
    on = plan(f"{A}.strategy=megatron", f"{RR}.mode=R2", f"{RR}.record_file=/tmp/r")
    assert on.trainer_kwargs["strategy"].router_replay == "R2"
    assert "router_replay='R2'" in repr(on.trainer_kwargs["strategy"])
    assert any(n.startswith(f"{RR}.mode=R2: the policy's updates route") for n in on.notes)
    assert any(n.startswith(f"{RR}.record_file has no effect") for n in on.notes)
    assert not plan(f"{A}.strategy=megatron").trainer_kwargs["strategy"].router_replay
    r3 = plan(f"{A}.strategy=megatron", f"{RR}.mode=R3", f"{ROLL}.enable_rollout_routing_replay=true", f"{ROLL}.name=hf")
    assert r3.trainer_kwargs["strategy"].router_replay == "R3"
    assert r3.rollout_cls.__name__ == "HFRollout" and r3.rollout_kwargs["return_routed_experts"]
    assert any(n.startswith(f"{RR}.mode=R3: every pass of the policy routes") for n in r3.notes)
    with pytest.raises(ConfigError, match=f"{RR}.mode=R3 replays the routing the rollout recorded: set "
                                          f"{ROLL}.enable_rollout_routing_replay=True"):
        plan(f"{A}.strategy=megatron", f"{RR}.mode=R3", f"{ROLL}.name=hf")
    recorded_only = plan(f"{A}.strategy=megatron", f"{ROLL}.enable_rollout_routing_replay=true", f"{ROLL}.name=hf")
    assert any("recorded but not replayed" in n for n in recorded_only.notes)
    if importlib.util.find_spec("vllm") is not None:
        with pytest.raises(NotSupportedError, match="MoE routing replay from the rollout with VLLMRollout on CPU .*"
                                                    "GPU Model Runner V2, which needs a CUDA GPU"):
            plan(f"{A}.strategy=megatron", f"{RR}.mode=R3", f"{ROLL}.enable_rollout_routing_replay=true",
                 f"{ROLL}.name=vllm")
    with pytest.raises(ConfigError, match="choose disabled, R2 or R3"):
        plan(f"{A}.strategy=megatron", f"{RR}.mode=R4")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="rollout.name=vllm needs vLLM installed")
def test_r3_with_the_vllm_rollout_is_planned_on_a_cuda_machine(monkeypatch):
    """On trainer.device=cuda (a machine with a GPU: one is pretended here, nothing starts) R3 with rollout.name=vllm
    plans VLLMRollout(return_routed_experts=True), whose engine starts vLLM with enable_return_routed_experts."""
    import rlflow.config.verl.devices as devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    RR, ROLL = f"{A}.megatron.router_replay", "actor_rollout_ref.rollout"
    r3 = plan(f"{A}.strategy=megatron", f"{RR}.mode=R3", f"{ROLL}.enable_rollout_routing_replay=true",
              f"{ROLL}.name=vllm", "trainer.device=cuda", "trainer.n_gpus_per_node=1")
    assert r3.rollout_cls.__name__ == "VLLMRollout" and r3.rollout_kwargs["return_routed_experts"]
    assert r3.trainer_kwargs["strategy"].router_replay == "R3"


def test_lora_on_a_moe_models_experts_is_refused_at_the_dry_run_and_its_attention_accepted(tmp_path, capsys):
    """verl's Megatron LoRA block targets linear_fc1/linear_fc2 by default, which on a MoE model are its routed
    experts: rlflow's Megatron LoRA adapts the attention only, so the dry run refuses those targets by name (before
    any weight loads) and accepts linear_qkv / linear_proj."""
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp_path / "model")
    Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                   vocab_size=len(tok)).save_pretrained(tmp_path / "model")
    pd.DataFrame(verl_rows(8, "train", 0)).to_parquet(tmp_path / "train.parquet")
    argv = ["--dry-run", f"actor_rollout_ref.model.path={tmp_path}/model", f"data.train_files={tmp_path}/train.parquet",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "algorithm.adv_estimator=grpo", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.logger=[console]", f"{A}.strategy=megatron",
            "actor_rollout_ref.model.lora.rank=4", f"trainer.default_local_dir={tmp_path}/run"]
    assert main(argv) != 0
    assert re.search(r"on a MoE model \(qwen3_moe\) adapts the attention .*\['down_proj', 'gate_proj', 'up_proj'\]",
                     capsys.readouterr().err)
    assert main(argv + ["actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj]"]) == 0
    out = capsys.readouterr().out
    assert "Dry run: config and data are valid" in out
    # 2 layers x r=4 x (q: 64+64, k: 64+32, v: 64+32, o: 64+64), all on the one rank; the base weights are frozen
    adapters = 2 * 4 * (128 + 96 + 96 + 128)
    assert re.search(rf"LoRA adapters / rank .* {adapters / 1e6:.3g} M", out), out
    assert "4 B/param frozen + 16 B/adapter param" in out and "frozen reference / rank" not in out


@pytest.mark.parametrize("config, targets", [
    (Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2), "all-linear"),
    (LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2), ["q_proj", "v_proj", "down_proj"]),
    (Qwen3MoeConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
     ["q_proj", "k_proj", "v_proj", "o_proj"]),
], ids=lambda c: getattr(c, "model_type", None) or "-")
def test_lora_memory_counts_peft_adapters_and_freezes_the_base(config, targets):
    """The adapter count of one layer equals PEFT's on the real model; under LoRA the model states are 4 B per
    frozen parameter plus 16 B per adapter parameter, and there is no reference copy (the adapter-off model)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=targets))
    layer0 = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n and ".layers.0." in n)
    assert lora_parameters(config, 4, targets) == layer0
    full = rank_memory(config, ParallelLayout(), 1, micro_batch=1, seq_len=8)
    lora = rank_memory(config, ParallelLayout(), 1, micro_batch=1, seq_len=8, lora=(4, targets))
    assert lora.adapter_parameters == 2 * layer0 and lora.reference == 0
    assert lora.model_states == 4 * full.parameters + 16 * 2 * layer0 < full.model_states


def test_lora_adapters_split_as_the_megatron_layers_place_them():
    """At TP 2 a column-parallel projection keeps A whole and splits B; a row-parallel one splits A, keeps B."""
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    # q: A 4x64 + B (64/2)x4; down: A 4x(96/2) + B 64x4
    assert lora_parameters(config, 4, ["q_proj"], tensor=2) == 4 * 64 + 32 * 4
    assert lora_parameters(config, 4, ["down_proj"], tensor=2) == 4 * 48 + 64 * 4


def test_a_moe_model_under_tensor_parallelism_is_refused_by_name_and_expert_parallel_accepted():
    """megatron-core splits experts over tensor-parallel ranks only with sequence parallelism, which the local spec
    does not run; before this check a Qwen3-MoE at TP 2 failed inside the conversion with a shape error."""
    from rlflow.strategies.megatron.model import architecture

    config = Qwen3MoeConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32)
    assert architecture(config, ParallelLayout(expert=2)).moe
    with pytest.raises(ValueError, match=r"qwen3_moe: MoE models run at tensor parallel 1 .*expert_parallel"):
        architecture(config, ParallelLayout(tensor=2))
    dense = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_attention_heads=4)
    assert not architecture(dense, ParallelLayout(tensor=2)).moe


def test_mtp_keys_are_the_megatron_strategys_and_refused_by_name_elsewhere(tmp_path, capsys):
    """verl's model.mtp under Megatron gives MegatronStrategy(mtp=MTPOptions(...)) with verl's values
    (tests/megatron/test_mtp.py trains with it); refused by name under FSDP, with speculative decoding
    (enable_rollout), and at the dry run for a checkpoint without MTP layers, which MiMo's passes."""
    from rlflow.models.mimo import save_tiny_mimo
    from rlflow.models.tiny import tiny_qwen2
    from rlflow.strategies.megatron.mtp import MTPOptions

    M = "actor_rollout_ref.model.mtp"
    keys = [f"{M}.enable=True", f"{M}.enable_train=True", f"{M}.mtp_loss_scaling_factor=0.2", f"{M}.detach_encoder=True"]
    on = plan(f"{A}.strategy=megatron", *keys)
    assert on.trainer_kwargs["strategy"].mtp == MTPOptions(train=True, loss_scaling_factor=0.2, detach_encoder=True)
    assert any(n.startswith(f"{M}.enable=True: the checkpoint's MTP layers run in megatron-core's") for n in on.notes)
    assert plan(f"{A}.strategy=megatron", f"{M}.enable=True").trainer_kwargs["strategy"].mtp == MTPOptions()
    assert plan(f"{A}.strategy=megatron").trainer_kwargs["strategy"].mtp is None
    with pytest.raises(NotSupportedError, match=rf"{M}.enable=True: multi-token prediction with {A}.strategy=fsdp"):
        plan(*keys)
    drafted = f"{M}.enable_rollout=True: speculative decoding drafted by the MTP layers with actor_rollout_ref.rollout"
    with pytest.raises(NotSupportedError, match=drafted):
        plan(f"{A}.strategy=megatron", *keys, f"{M}.enable_rollout=True")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    body = tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    body.save_pretrained(tmp_path / "qwen2")
    save_tiny_mimo(tmp_path / "mimo", body)
    for name in ("qwen2", "mimo"):
        tok.save_pretrained(tmp_path / name)
    pd.DataFrame(verl_rows(8, "train", 0)).to_parquet(tmp_path / "train.parquet")
    argv = ["--dry-run", f"data.train_files={tmp_path}/train.parquet", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=8", f"{A}.ppo_mini_batch_size=8",
            "trainer.logger=[console]", "model_engine=megatron", f"trainer.default_local_dir={tmp_path}/run",
            "data.max_prompt_length=8", "data.max_response_length=4", *keys]
    assert main(argv + [f"actor_rollout_ref.model.path={tmp_path}/qwen2"]) != 0
    assert f"{M}.enable=True but actor_rollout_ref.model.path={tmp_path}/qwen2 has no multi-token prediction layers" \
        in capsys.readouterr().err
    assert main(argv + [f"actor_rollout_ref.model.path={tmp_path}/mimo"]) == 0
    assert "Dry run: config and data are valid" in capsys.readouterr().out
