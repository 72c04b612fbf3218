"""verl's algorithm.use_pf_ppo / algorithm.pf_ppo.* through the verl entry point: PFPPO after GAE."""

import pytest

from rlflow.algorithms import GAE


def test_entry_point_chains_pf_ppo_after_gae_and_notes_it_elsewhere(tiny, model_dir):
    from rlflow.config import load_config, make_plan
    from rlflow.config.verl.build import build_estimator, build_reward
    from rlflow.config.verl.loading import ConfigError
    from rlflow.rollout import HFRollout

    gae = [o for o in tiny if not o.startswith("algorithm.adv_estimator")] + [
        "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", "algorithm.use_pf_ppo=true",
        "algorithm.pf_ppo.reweight_method=max_min"]
    plan = make_plan(load_config(gae))
    assert [(c.__name__, kw) for c, kw in plan.after] == [("PFPPO", {"reweight_method": "max_min", "weight_pow": 2.0})]
    chain, _ = build_estimator(plan, HFRollout(n=2, max_new_tokens=4), None)
    assert [type(m).__name__ for m in chain.modules] == ["GAE", "PFPPO"]
    assert isinstance(chain.modules[0], GAE) and chain.modules[1].reweight_method == "max_min"
    grpo = make_plan(load_config(tiny + ["algorithm.use_pf_ppo=true"]))
    assert not grpo.after and any("use_pf_ppo=True has no effect with algorithm.adv_estimator=grpo" in n
                                  for n in grpo.notes)
    with pytest.raises(ConfigError, match="algorithm.pf_ppo.reweight_method='median'"):
        make_plan(load_config(gae + ["algorithm.pf_ppo.reweight_method=median"]))
