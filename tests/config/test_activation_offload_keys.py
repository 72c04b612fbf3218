"""verl's actor_rollout_ref.model.enable_activation_offload / critic.model.enable_activation_offload reach Policy
and Critic (tests/models/test_activation_offload.py: what they do)."""

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan


def test_verl_keys_reach_policy_and_critic(tiny, model_dir, monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    p = make_plan(load_config(tiny + ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}",
                                      "actor_rollout_ref.model.enable_activation_offload=true",
                                      "critic.model.enable_activation_offload=true"]))
    assert p.policy_kwargs["activation_offload"] and p.critic_kwargs["activation_offload"]
    from rlflow.config.verl.build import build_critic, build_policy

    assert build_policy(p).activation_offload and build_critic(p).activation_offload
    assert "activation_offload" not in make_plan(load_config(tiny)).policy_kwargs
