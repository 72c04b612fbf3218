"""docs/verl-compat.md's refusals made outside the key tables agree with the verl entry point (issue 23, "no silent
acceptance"). Every row of the page whose text says "not supported" or "refused" -- beyond the keys
``tables.NOT_SUPPORTED`` refuses, which test_verl_compat_tables checks -- is read from the page, and a small config
per row (``TRIGGERS``) must be refused by validation and plan building (no training), the error naming the key. A
row added to the page later fails ``test_every_refusal_row_has_a_trigger`` until it gets one here.

The reverse: a row that says a key is honoured, whose key ``tables.INERT`` notes whatever else is set (a reason not
starting "only used with"), must be read when set: no "has no effect" note for it."""

import importlib.util
import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl import tables
from rlflow.config.verl.key_notes import unused_notes
from rlflow.config.verl.loading import flatten
from tests.config.test_datagen_keys import VERL_STYLE as VERL_DATAGEN
from tests.config.test_group_sampler_keys import LONGEST, VERL_STYLE as VERL_SAMPLER
from tests.config.test_multi_turn_keys import VERL_LOOP
from tests.config.test_reward_class_keys import DATAPROTO_ONLY, VERL_STYLE as VERL_MANAGER

PAGE = (Path(__file__).parents[2] / "docs" / "verl-compat.md").read_text()
REFUSAL = re.compile(r"not supported|refused", re.I)
# Rows another helper is changing now (Megatron's precision-aware optimizer and *_offload keys, qat.*, sandbox_fusion.*):
# checked once their work lands.
SKIPPED = ("*use_precision_aware_optimizer", "*.megatron.*_offload", "*sandbox_fusion.*")
# Rows whose "refused" is not a refusal of their key.
NOT_REFUSALS = {
    "actor_rollout_ref.rollout.server.retries": "the server's refused connections, which ServerRollout retries",
    "*.fsdp_config.turbo_config": "strategy=fsdp_turbo is refused (tables.NOT_SUPPORTED, actor.strategy); the keys "
                                  "under turbo_config get a note",
}
# Rows refused when the trainer is built, not by validation: the test that checks each.
BUILT = {
    "actor_rollout_ref.rollout.skip_rollout": "test_replay_keys::test_a_folder_verl_dumped_into_is_refused_saying_so",
}
A, R, M, D = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model", "distillation"
MEGATRON_LORA = [f"{A}.strategy=megatron", f"{M}.lora.rank=8"]
TEACHER = [f"{D}.enabled=true", f"{D}.teacher_models.teacher_model.model_path={{model}}"]
REWARD_MODEL = ["reward_model.enable=true", "reward_model.model.path={model}"]
CUDA = "trainer.device=cuda"  # with it, the test's machine has one CUDA device (devices.cuda_count)
FULLY_ASYNC = ["async_training.partial_rollout=true"]
# row (its first key) -> (the key the error must name, the overrides that trigger it); {tmp}: the test's folder,
# holding FILES; {model}: the tiny model's folder
TRIGGERS: dict[str, list[tuple[str, list[str]]]] = {
    "reward_model.reward_loop_source": [("reward_model.reward_loop_module_path", [
        "reward_model.reward_loop_source=importlib", "reward_model.reward_loop_module_path={tmp}/annotated.py",
        "reward_model.reward_loop_class_name=Scorer"])],
    f"{D}.teacher_key": [(f"{D}.teacher_key", TEACHER + [f"{D}.teacher_key=ability"])],
    f"{D}.distillation_loss.use_policy_gradient": [
        (f"{D}.distillation_loss.policy_loss_mode", TEACHER + [f"{D}.distillation_loss.use_policy_gradient=true",
                                                               f"{D}.distillation_loss.policy_loss_mode=gspo"]),
        (f"{D}.distillation_loss.loss_mode", TEACHER + [f"{D}.distillation_loss.loss_mode=k1"])],
    "data.datagen.path": [("data.datagen.path", ["data.datagen.path={tmp}/gen.py", "data.datagen.name=Questions"])],
    f"{M}.use_liger": [(f"{M}.use_liger", [f"{M}.use_liger=true"]),
                       (f"{M}.use_liger", [f"{M}.use_liger=true", f"{A}.strategy=megatron"])],
    f"{A}.optim.override_optimizer_config": [(f"{A}.optim.override_optimizer_config.optimizer_cpu_offload", [
        CUDA, f"+{A}.optim.override_optimizer_config.optimizer_cpu_offload=true"])],
    **{f"{A}.fsdp_config.{k}": [(f"{A}.fsdp_config.{k}", [CUDA, f"{A}.fsdp_config.{k}=true"])]
       for k in ("param_offload", "optimizer_offload", "offload_policy")},
    "critic.fsdp.param_offload": [("critic.fsdp.param_offload", [
        CUDA, "critic.fsdp.param_offload=true", "algorithm.adv_estimator=gae", "critic.model.path={model}"])],
    f"{R}.name": [(f"{R}.name='trtllm': the trtllm rollout engine is not supported yet", [f"{R}.name=trtllm"])],
    f"{R}.ignore_eos": [(f"{R}.ignore_eos", [f"{R}.name=vllm", f"{R}.ignore_eos=true"]),
                        (f"{R}.ignore_eos", [f"{R}.name=sglang", f"{R}.server.url=http://localhost:1",
                                             f"{R}.ignore_eos=true"])],
    f"{R}.multi_turn.enable": [(f"{R}.multi_turn.enable", [f"{R}.multi_turn.enable=true", f"{R}.name=vllm"]
                                + FULLY_ASYNC),
                               ("async_training.pause_mode", [f"{R}.multi_turn.enable=true",
                                                              "async_training.pause_mode=keep"] + FULLY_ASYNC)],
    f"{R}.multi_turn.format": [(f"{R}.multi_turn.format", [f"{R}.multi_turn.enable=true",
                                                          f"{R}.multi_turn.format=qwen"])],
    f"{R}.agent.agent_loop_config_path": [(f"{R}.agent.agent_loop_config_path", [f"{R}.multi_turn.enable=true",
                                                             f"{R}.agent.agent_loop_config_path={{tmp}}/loops.yaml",
                                                             f"{R}.agent.default_agent_loop=mine"])],
    f"{R}.checkpoint_engine.backend": [
        (f"{R}.checkpoint_engine.backend", [f"{R}.checkpoint_engine.backend={b}"])
        for b in ("nccl", "hccl", "nixl", "kimi_ckpt_engine")] + [
        (f"{R}.checkpoint_engine.backend", [CUDA, f"{R}.checkpoint_engine.backend=nccl"] + name)
        for name in ([], [f"{R}.name=vllm"])],
    f"{A}.megatron.router_replay.record_file": [(f"{A}.megatron.router_replay.replay_file", [
        f"{A}.strategy=megatron", f"{A}.megatron.router_replay.replay_file=x"])],
    f"{R}.enable_rollout_routing_replay": [
        (f"{R}.enable_rollout_routing_replay", [f"{R}.name=vllm", f"{R}.enable_rollout_routing_replay=true"] + server)
        for server in ([], [f"{R}.server.url=http://localhost:1"])],
    f"{R}.quantization": [(f"{R}.quantization", [f"{R}.quantization={q}"] + name) for q, name in (
        ("fp8", [f"{R}.name=vllm"]), ("fp8", []), ("torchao", [f"{R}.name=vllm"]), ("ascend", [f"{R}.name=vllm"]))],
    f"{M}.mtp.enable": [(f"{M}.mtp.enable", [f"{M}.mtp.enable=true"])],
    f"{M}.mtp.enable_rollout": [(f"{M}.mtp.enable_rollout", [f"{A}.strategy=megatron", f"{M}.mtp.enable=true",
                                                             f"{M}.mtp.enable_rollout=true"])],
    f"{M}.lora.type": [(f"{M}.lora.type", MEGATRON_LORA + [f"{M}.lora.type={t}"]) for t in ("dora", "vlm_lora")],
    f"{M}.lora.target_modules": [(f"{M}.lora.target_modules", MEGATRON_LORA + [f"{M}.lora.target_modules=[{t}]"])
                                 for t in ("linear_*", "router")],
    f"{M}.lora.dropout": [(f"{M}.lora.dropout", MEGATRON_LORA + [f"{M}.lora.dropout=0.1"])],
    f"{M}.lora.lora_A_init_method": [(f"{M}.lora.lora_B_init_method",
                                      MEGATRON_LORA + [f"{M}.lora.lora_B_init_method=xavier"])],
    f"{M}.lora.adapter_path": [(f"{M}.lora.adapter_path", MEGATRON_LORA + [f"{M}.lora.adapter_path=x"])],
    "reward_model.strategy": [("reward_model.strategy", REWARD_MODEL + ["reward_model.strategy=megatron"])],
    "trainer.logger": [("trainer.logger", ["trainer.logger=[console,swanlab]"]),
                       ("trainer.logger", ["trainer.logger=[console,vemlp_wandb]"])],
    "reward_model.ulysses_sequence_parallel_size": [("reward_model.ulysses_sequence_parallel_size", REWARD_MODEL + [
        "reward_model.ulysses_sequence_parallel_size=2"])],
    "reward.reward_manager.source": [("reward.reward_manager.module.path", [
        "reward.reward_manager.source=importlib", "reward.reward_manager.module.path={tmp}/verl_manager.py",
        "reward.reward_manager.name=MyManager"])],
    "trainer.v1.sampler.custom_sampler.path": [("trainer.v1.sampler.custom_sampler.path", [
        "trainer.v1.trainer_mode=colocate_async", f"trainer.v1.sampler.custom_sampler.path={{tmp}}/{file}",
        f"trainer.v1.sampler.custom_sampler.name={name}"] + mode) for file, name, mode in (
        ("verl_sampler.py", "MySampler", []), ("sampler.py", "Longest", ["trainer.v1.trainer_mode=sync"]))],
    "async_training.trigger_parameter_sync_step": [
        ("async_training.trigger_parameter_sync_step", ["trainer.async_weight_update=true",
                                                        f"async_training.trigger_parameter_sync_step={t}"] + epochs)
        for t, epochs in ((3, []), (2, [f"{A}.ppo_epochs=2"]))],
    **{f"skip.{s}.enable": [(f"skip.{s}.enable", [f"skip.{s}.enable=true", "trainer.async_weight_update=true"])]
       for s in ("rollout", "rollout_tq", "async_rollout")},
    f"{A}.qat.enable": [(f"{A}.qat.mode", [f"{A}.qat.enable=true", f"{A}.qat.mode=w4a4"]),
                        (f"{A}.qat.enable", [f"{A}.qat.enable=true", f"{M}.lora_rank=4"]),
                        (f"{A}.qat.enable", [f"{A}.qat.enable=true", f"{A}.strategy=megatron"])],
    f"{A}.megatron.qat.enable": [(f"{A}.megatron.qat.enable", [f"{A}.megatron.qat.enable=true"]),
                                 (f"{A}.megatron.qat.enable", [f"{A}.megatron.qat.enable=true", f"{A}.strategy=megatron"])],
    "critic.megatron.qat.enable": [("critic.megatron.qat.enable", ["algorithm.adv_estimator=gae", "critic.model.path={model}",
                                                                   "critic.megatron.qat.enable=true"])],
}
FILES = {"annotated.py": DATAPROTO_ONLY, "gen.py": VERL_DATAGEN, "verl_manager.py": VERL_MANAGER,
         "my_loop.py": VERL_LOOP, "loops.yaml": "- name: mine\n  _target_: {tmp}/my_loop.py:MyAgentLoop\n",
         "sampler.py": LONGEST, "verl_sampler.py": VERL_SAMPLER}


def table_rows() -> dict[str, tuple[list[str], str]]:
    """The page's table rows: the row's first key -> (its keys, its last cell); a key without a dot
    (``| `a.b.c`, `d` |``) is a sibling of the first (``a.b.d``)."""
    rows = {}
    for line in PAGE.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        keys = re.findall(r"`([^`]+)`", cells[0])
        parent = keys[0].rpartition(".")[0]
        rows[keys[0]] = ([k if "." in k or not parent else f"{parent}.{k}" for k in keys], cells[-1])
    return rows


def in_table(key: str) -> bool:
    return any(fnmatchcase(key, p) or p == key + ".*" for p in tables.NOT_SUPPORTED)


def refusal_rows() -> list[str]:
    """Rows that say a key is refused outside ``tables.NOT_SUPPORTED`` (rows that begin "no effect" note the key)."""
    return [first for first, (keys, text) in table_rows().items()
            if REFUSAL.search(text) and not text.startswith("no effect") and not all(map(in_table, keys))
            and not any(fnmatchcase(k, p) for k in keys for p in SKIPPED)]


def test_every_refusal_row_has_a_trigger():
    rows = refusal_rows()
    missing = [r for r in rows if r not in TRIGGERS and r not in NOT_REFUSALS and r not in BUILT]
    assert not missing, f"docs/verl-compat.md says these are refused; add a config refusing each to TRIGGERS: {missing}"
    stale = [r for r in TRIGGERS if r not in rows]
    assert not stale, f"TRIGGERS has rows the page no longer says are refused: {stale}"


NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="a vLLM rollout's refusal: without vLLM the install hint comes first")


def cases():
    return [pytest.param(named, overrides, id=f"{row}[{i}]",
                         marks=[NEEDS_VLLM] if any(o.endswith(".name=vllm") for o in overrides) else [])
            for row, triggers in TRIGGERS.items() for i, (named, overrides) in enumerate(triggers)]


@pytest.mark.parametrize("named, overrides", cases())
def test_every_refusal_row_is_refused_naming_its_key(named, overrides, tiny, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: int(CUDA in overrides))
    for name, text in FILES.items():
        (tmp_path / name).write_text(text.replace("{tmp}", str(tmp_path)))
    keys = [o.replace("{tmp}", str(tmp_path)).replace("{model}", str(model_dir)) for o in overrides]
    with pytest.raises(ConfigError) as refusal:
        make_plan(load_config(tiny + keys))
    said = " ".join(str(refusal.value).split())
    assert named in said, said


def honoured_rows() -> list[str]:
    """Keys of rows that say nothing of "no effect" or refusals, which ``tables.INERT`` notes unconditionally."""
    defaults = flatten(load_config([]).tree)
    return [k for keys, text in table_rows().values() if not re.search(r"no effect|not supported|refused", text)
            for k in keys if k in defaults and tables.inert_reason(k) and not tables.inert_reason(k).startswith("only")]


@pytest.mark.parametrize("key", honoured_rows())
def test_a_key_the_page_says_is_honoured_is_read(key, tiny, model_dir, monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    default = flatten(load_config([]).tree)[key]
    assert isinstance(default, bool), f"{key}: give the test a value to set it to"
    roles = [f"{A}.use_kl_loss=true", "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}"]
    plan = make_plan(load_config(tiny + roles + [f"{key}={str(not default).lower()}"]))
    silent = [n for n in unused_notes(plan.cfg) if n.startswith(f"{key}=") and "has no effect" in n]
    assert not silent, f"docs/verl-compat.md says {key} is honoured, but: {silent}"
