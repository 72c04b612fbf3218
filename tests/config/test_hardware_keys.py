"""verl keys that name a backend or hardware: the checkpoint engine maps onto rlflow's weight transfer, and what
needs hardware or a package rlflow does not use is refused naming it."""

import dataclasses
import re
import sys

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl.modeldata import liger
from rlflow.cli import main as cli_main
from rlflow.config.verl.rollout import checkpoint_engine, quantization

R = "actor_rollout_ref.rollout"
ENGINE = f"{R}.checkpoint_engine.backend"
SERVER = [f"{R}.name=vllm", f"{R}.server.url=http://127.0.0.1:9"]  # a client's plan: no server is reached


def on_cuda(plan):
    """The plan's devices as a CUDA machine would resolve them (this machine has no GPU)."""
    return dataclasses.replace(plan.devices, accelerator="cuda")


@pytest.fixture
def one_gpu(monkeypatch):
    """Plans as on a machine with one CUDA device (the plan is only resolved, nothing runs on it)."""
    monkeypatch.setattr(devices, "cuda_count", lambda: 1)
    return ["trainer.device=cuda"]


def test_naive_is_rlflow_default_weight_transfer(tiny):
    plan = make_plan(load_config(tiny + SERVER + [f"{ENGINE}=naive"]))
    assert plan.rollout_kwargs["weight_transfer"] == "auto"
    assert not any(n.startswith(ENGINE) for n in plan.notes)


def test_nccl_sends_weights_to_a_vllm_server_over_nccl_on_cuda(tiny, one_gpu):
    cfg = load_config(tiny + SERVER + [f"{ENGINE}=nccl"])
    with pytest.raises(NotSupportedError, match=f"{ENGINE}='nccl': weight transfer over NCCL without CUDA GPUs"):
        make_plan(cfg)  # trainer.device=cpu
    plan = make_plan(load_config(tiny + SERVER + [f"{ENGINE}=nccl"] + one_gpu))
    assert plan.rollout_cls.__name__ == "ServerRollout" and plan.rollout_kwargs["weight_transfer"] == "nccl"
    assert [n for n in plan.notes if n.startswith(ENGINE)] == [f"{ENGINE}=nccl: weights go to the vLLM server over NCCL through vLLM's weight-transfer protocol "
                     f"({R}.server.weight_transfer='nccl', which auto also picks for a server on CUDA), as verl's "
                     "nccl engine broadcasts them"]
    clash = load_config(tiny + SERVER + [f"{ENGINE}=nccl", f"{R}.server.weight_transfer=rlflow_gloo"] + one_gpu)
    with pytest.raises(ConfigError, match="server.weight_transfer='rlflow_gloo'; set one of them"):
        make_plan(clash)


@pytest.mark.parametrize("rollout, where", [("HFRollout", "the HF rollout"), ("VLLMRollout", "the in-process vLLM engine"),
                                            ("SGLangRollout", "an SGLang server")])
def test_nccl_to_a_rollout_sharing_the_trainer_gpu_is_refused(tiny, rollout, where):
    plan = make_plan(load_config(tiny))  # vLLM's in-process engine cannot start here: the mapping is checked alone
    with pytest.raises(NotSupportedError, match=f"weights over NCCL to {where}.*server.url"):
        checkpoint_engine(load_config(tiny + [f"{ENGINE}=nccl"]), on_cuda(plan), [], rollout)


@pytest.mark.parametrize("backend, needs", [("hccl", "Ascend NPUs"), ("nixl", "NIXL transfer library"),
                                            ("kimi_ckpt_engine", "Mooncake transfer engine")])
def test_engines_of_other_hardware_or_libraries_are_refused_naming_them(tiny, backend, needs):
    with pytest.raises(NotSupportedError, match=f"{ENGINE}='{backend}': verl's {backend} checkpoint engine, which "
                                                f"needs .*{needs}"):
        make_plan(load_config(tiny + [f"{ENGINE}={backend}"]))


def test_an_unknown_engine_is_a_config_error_listing_the_known(tiny):
    with pytest.raises(ConfigError, match=f"{ENGINE}='nxil': unknown checkpoint engine; choose from naive, nccl, hccl"):
        make_plan(load_config(tiny + [f"{ENGINE}=nxil"]))


@pytest.mark.parametrize("override, needs", [
    (f"{R}.trace.backend=weave", "Weave project .weave: a W&B account and server"),
    (f"{R}.quantization=torchao", "torchao's quantized layers"),
    (f"{R}.disaggregation.enabled=true", "prefill and decode replicas of SGLang/vLLM servers on GPUs"),
    ("trainer.default_hdfs_dir=hdfs://ckpt", "HDFS .* hdfs command-line client"),
])
def test_refusals_name_the_hardware_or_package_they_need(tiny, override, needs):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}=.*{needs}"):
        make_plan(load_config(tiny + [override]))


# ---------------------------------------------------------------- Liger kernels (tests/models/test_liger.py: the patch)
LIGER = ["actor_rollout_ref.model.use_liger=true", "critic.model.use_liger=true", "algorithm.adv_estimator=gae"]


@pytest.mark.parametrize("role", ["actor_rollout_ref", "critic"])
def test_use_liger_is_refused_on_cpu_naming_the_cuda_gpu_it_needs(tiny, role):
    with pytest.raises(NotSupportedError, match=f"{role}.model.use_liger=True: Liger kernels without a CUDA GPU "
                                                r"\(liger-kernel's Triton kernels run on CUDA GPUs; this run is on CPU"):
        liger(load_config(tiny + LIGER), make_plan(load_config(tiny)).devices, role)


def test_use_liger_reaches_both_models_from_pretrained_on_cuda(tiny, one_gpu, monkeypatch):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install -e \".[liger]\")")
    plan = make_plan(load_config(tiny + LIGER + one_gpu))
    assert plan.policy_kwargs["use_liger"] and plan.critic_kwargs["use_liger"]
    plain = make_plan(load_config(tiny + LIGER[2:] + one_gpu))
    assert "use_liger" not in plain.policy_kwargs and "use_liger" not in plain.critic_kwargs
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as on a machine without the package
    with pytest.raises(ConfigError, match="use_liger=True: the liger-kernel package is not installed: "
                                          r'pip install -e "\.\[liger\]"'):
        make_plan(load_config(tiny + LIGER + one_gpu))


def test_use_liger_on_cpu_is_refused_by_the_plan(tiny):
    with pytest.raises(NotSupportedError, match="actor_rollout_ref.model.use_liger=True: Liger kernels without a CUDA"):
        make_plan(load_config(tiny + LIGER[:1]))


def test_use_liger_under_megatron_is_refused_naming_the_transformers_models_it_patches(tiny, one_gpu):
    cfg = load_config(tiny + LIGER[:1] + ["actor_rollout_ref.actor.strategy=megatron"] + one_gpu)
    with pytest.raises(NotSupportedError, match="Liger kernels under the Megatron strategy .* patches transformers"):
        make_plan(cfg)


# ------------------------------------------------ quantized rollouts (tests/rollout/test_vllm_quantization.py: the engine)
FP8 = [f"{R}.name=vllm", f"{R}.quantization=fp8"]


def test_fp8_rollouts_go_to_the_vllm_engine_on_cuda_and_the_dry_run_accepts_them(tiny, one_gpu, capsys):
    pytest.importorskip("vllm", reason="without vLLM the dry run stops at its install hint first")
    plan = make_plan(load_config(tiny + one_gpu + FP8))
    assert plan.rollout_cls.__name__ == "VLLMRollout" and plan.rollout_kwargs["quantization"] == "fp8"
    assert any(n.startswith(f"{R}.quantization='fp8': vLLM samples from fp8 weights") for n in plan.notes)
    assert cli_main(["train"] + tiny + one_gpu + FP8 + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"VLLMRollout\(.*quantization='fp8'", out) and "Dry run: config and data are valid" in out


def test_fp8_rollouts_on_cpu_are_refused_naming_cuda_and_the_dry_run_says_so(tiny, capsys):
    pytest.importorskip("vllm", reason="without vLLM the dry run stops at its install hint first")
    with pytest.raises(NotSupportedError, match=f"{R}.quantization='fp8': quantized rollouts without a CUDA GPU "
                                                r"\(trainer.device=cuda\) .* run on CUDA GPUs .* this run is on cpu"):
        make_plan(load_config(tiny + FP8))
    assert cli_main(["train"] + tiny + FP8 + ["--dry-run"]) != 0
    assert "quantized rollouts without a CUDA GPU" in capsys.readouterr().err


def test_fp8_with_other_rollouts_a_server_note_and_unknown_values(tiny):
    """The HF rollout generates with the policy's weights: refused; a server quantizes as its command line says: a
    note giving vLLM's flags; a value verl does not have either: an error listing rlflow's."""
    cpu = make_plan(load_config(tiny)).devices
    with pytest.raises(NotSupportedError, match=r"quantized rollouts with HFRollout \(it generates with .*rollout.name=vllm rolls out fp8"):
        quantization(load_config(tiny + [f"{R}.quantization=fp8"]), on_cuda(make_plan(load_config(tiny))), [],
                     "HFRollout")
    notes = []
    assert quantization(load_config(tiny + [f"{R}.quantization=fp8"]), cpu, notes, "ServerRollout") is None
    assert notes == [f"{R}.quantization='fp8': a setting of the server: give it to the server's own command line "
                     "(rollout.server.launch); a vLLM server takes --quantization fp8_per_block --quantization-config "
                     '{"ignore": ["*.mlp.gate"]} (vllm_server_command(..., quantization=\'fp8\'))']
    with pytest.raises(ConfigError, match="quantization='int4': unknown quantization; rlflow rolls out fp8 .*torchao"):
        quantization(load_config(tiny + [f"{R}.quantization=int4"]), cpu, [], "VLLMRollout")
