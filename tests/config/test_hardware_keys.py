"""verl keys that name a backend or hardware: the checkpoint engine maps onto rlflow's weight transfer, and what
needs hardware or a package rlflow does not use is refused naming it."""

import dataclasses
import sys

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, NotSupportedError, load_config, make_plan
from rlflow.config.verl.modeldata import liger
from rlflow.config.verl.rollout import checkpoint_engine

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
    (f"{R}.quantization=fp8", "quantization= engine argument, e.g. fp8, whose kernels need CUDA GPUs"),
    ("actor_rollout_ref.actor.qat.enable=true", "NVFP4 .* NVIDIA GPUs"),
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
