"""verl's optimizer, schedule, shuffle and loss keys through the verl entry point: each reaches the object it sets.

Expected values are verl 0.9.1's formulas written out here (``verl/utils/torch_functional.py``,
``verl/trainer/ppo/core_algos.py::compute_policy_loss_sapo``), not rlflow's code.
"""

import math

import pytest
import torch
from tensordict import TensorDict

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.run import unused_notes
from rlflow.data import keys as K
from rlflow.trainer.main_ppo import main
from tests.config.test_main_ppo import steps

A, C = "actor_rollout_ref.actor", "critic"
OPT = f"{A}.optim"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def plan(tiny, *overrides):
    return make_plan(load_config(tiny + list(overrides)))


def notes(p):
    return "\n".join([*p.notes, *unused_notes(p.cfg)])


def verl_cosine(step, warmup, total, min_lr_ratio=0.0, num_cycles=0.5):
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def test_cosine_floor_and_cycles_set_the_lr_of_every_step(tiny, capsys):
    """5 steps of cosine with 1 warm-up step, floor 0.4 and a full cycle: actor/lr of step s is verl's factor at
    s - 1 (the schedule steps after the update), times optim.lr."""
    lr = 1e-3
    assert main(tiny + [f"{OPT}.lr={lr}", f"{OPT}.lr_scheduler_type=cosine", f"{OPT}.lr_warmup_steps=1",
                        f"{OPT}.min_lr_ratio=0.4", f"{OPT}.num_cycles=1.0", "trainer.total_training_steps=5",
                        "trainer.val_before_train=false"]) == 0
    logged = steps(capsys.readouterr().out)
    want = [lr * verl_cosine(s, 1, 5, 0.4, 1.0) for s in range(5)]
    assert [logged[s]["actor/lr"] for s in range(1, 6)] == pytest.approx(want, rel=1e-6)
    assert want[3] == pytest.approx(lr * 0.4) and want[4] > want[3]  # the floor, then back up (a full wave)


def test_schedule_keys_and_warmup_style(tiny):
    s = plan(tiny, f"{OPT}.warmup_style=cosine", f"{OPT}.min_lr_ratio=0.1", f"{OPT}.num_cycles=2",
             f"{OPT}.zero_indexed_step=false").trainer_kwargs["lr_schedule"]
    assert (s.kind, s.min_lr_ratio, s.num_cycles, s.zero_indexed_step) == ("cosine", 0.1, 2.0, False)
    both = plan(tiny, f"{OPT}.warmup_style=cosine", f"{OPT}.lr_scheduler_type=constant")
    assert both.trainer_kwargs["lr_schedule"].kind == "cosine"  # verl: the deprecated name wins when set
    assert "warmup_style='cosine' replaces actor_rollout_ref.actor.optim.lr_scheduler_type='constant'" in notes(both)
    assert plan(tiny).trainer_kwargs["lr_schedule"].kind == "constant"
    with pytest.raises(ConfigError, match=r"min_lr_ratio=1.5: must be in \[0, 1\]"):
        plan(tiny, f"{OPT}.min_lr_ratio=1.5")


def test_critic_side_schedule_keys_apply_to_both(tiny, model_dir):
    ppo = ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}"]
    p = plan(tiny, *ppo, f"{C}.optim.min_lr_ratio=0.2", f"{C}.optim.num_cycles=1.0")
    assert (p.trainer_kwargs["lr_schedule"].min_lr_ratio, p.trainer_kwargs["lr_schedule"].num_cycles) == (0.2, 1.0)
    assert "critic.optim.min_lr_ratio=0.2 applies to the actor too" in notes(p)
    with pytest.raises(ConfigError, match="critic.optim.num_cycles=1.0 differs from .*num_cycles=2.0"):
        plan(tiny, *ppo, f"{C}.optim.num_cycles=1.0", f"{OPT}.num_cycles=2.0")


@pytest.mark.parametrize("overrides, clip", [
    ([], 1.0), ([f"{OPT}.clip_grad=0.5"], 0.5), ([f"{A}.grad_clip=0.7"], 0.7), ([f"{A}.max_grad_norm=0.3"], 0.3),
    ([f"{OPT}.clip_grad=0.5", f"{A}.grad_clip=0.5"], 0.5)])
def test_clip_grad_and_its_older_names(tiny, overrides, clip):
    assert plan(tiny, *overrides).trainer_kwargs["max_grad_norm"] == clip


def test_conflicting_clip_names_are_an_error_naming_both(tiny, model_dir):
    with pytest.raises(ConfigError, match=r"optim.clip_grad=0.5 and actor_rollout_ref.actor.grad_clip=2.0 disagree"):
        plan(tiny, f"{OPT}.clip_grad=0.5", f"{A}.grad_clip=2.0")
    with pytest.raises(ConfigError, match=r"critic.optim.clip_grad=0.5 and critic.grad_clip=2.0 disagree"):
        plan(tiny, "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", f"{C}.optim.clip_grad=0.5",
             f"{C}.grad_clip=2.0")
    p = plan(tiny, "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", f"{C}.grad_clip=0.25")
    assert p.trainer_kwargs["max_grad_norm"] == 0.25  # the critic's older name, the side the user set


def test_shuffle_and_its_seed(tiny, model_dir):
    assert plan(tiny).trainer_kwargs["shuffle_seed"] is None
    assert plan(tiny, f"{A}.shuffle=true").trainer_kwargs["shuffle_seed"] == 42  # verl's data_loader_seed
    assert plan(tiny, f"{A}.shuffle=true", f"{A}.data_loader_seed=7").trainer_kwargs["shuffle_seed"] == 7
    p = plan(tiny, "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", f"{C}.shuffle=true")
    assert p.trainer_kwargs["shuffle_seed"] == 42 and "critic.shuffle=True applies to the actor too" in notes(p)


def test_sapo_temperatures_in_verls_example_spelling(tiny):
    """verl's SAPO example writes +actor.policy_loss.tau_pos (verl reads actor.tau_pos): both reach SAPOLoss, whose
    loss is verl's -sigmoid(tau (r - 1)) * 4 / tau * A, seq-mean-token-mean."""
    p = plan(tiny, f"{A}.policy_loss.loss_mode=sapo", f"+{A}.policy_loss.tau_pos=2.0", f"+{A}.policy_loss.tau_neg=3.0")
    assert (p.loss_kwargs["tau_pos"], p.loss_kwargs["tau_neg"]) == (2.0, 3.0)
    assert plan(tiny, f"{A}.policy_loss.loss_mode=sapo", f"{A}.tau_neg=1.5").loss_kwargs["tau_neg"] == 1.5
    with pytest.raises(ConfigError, match=r"actor.tau_pos=1.2 and actor_rollout_ref.actor.policy_loss.tau_pos=2.0"):
        plan(tiny, f"{A}.policy_loss.loss_mode=sapo", f"{A}.tau_pos=1.2", f"+{A}.policy_loss.tau_pos=2.0")
    loss = p.loss_cls(**p.loss_kwargs)
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])
    old = torch.tensor([[-1.2, -0.5, -1.5], [-0.3, -1.0, -0.9]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = TensorDict({K.LOG_PROBS: logp, K.OLD_LOG_PROBS: old, K.ADVANTAGES: adv, K.RESPONSE_MASK: mask}, [2])
    per_seq = []
    for i in range(2):
        terms = []
        for t in range(3):
            if mask[i, t]:
                tau = 2.0 if adv[i, t] > 0 else 3.0
                r = math.exp(logp[i, t] - old[i, t])
                terms.append(-(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * adv[i, t].item())
        per_seq.append(sum(terms) / len(terms))
    assert loss.pg_loss(batch)[0].item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)


def test_string_is_threshold_and_batch_normalize(tiny):
    rc = "algorithm.rollout_correction"
    p = plan(tiny, f"{rc}.rollout_is=token", f"{rc}.rollout_is_threshold='0.5_4.0'",
             f"{rc}.rollout_is_batch_normalize=true")
    [(cls, kwargs)] = p.after
    assert kwargs == {"level": "token", "threshold": 4.0, "lower": 0.5, "batch_normalize": True}
    module = cls(**kwargs)
    assert (module.threshold, module.lower, module.batch_normalize) == (4.0, 0.5, True)
    assert plan(tiny, f"{rc}.rollout_is=sequence", f"{rc}.rollout_is_threshold=3").after[0][1]["threshold"] == 3.0
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='4_0.5': .*lower bound"):
        plan(tiny, f"{rc}.rollout_is=token", f"{rc}.rollout_is_threshold='4_0.5'")
    assert "rollout_is_batch_normalize=True has no effect in rlflow: only used with" in notes(
        plan(tiny, f"{rc}.rollout_is_batch_normalize=true"))


def test_fused_kernels_are_accepted_with_a_note(tiny):
    p = plan(tiny, "actor_rollout_ref.model.use_fused_kernels=true",
             "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton")
    text = notes(p)
    assert "use_fused_kernels=True has no effect in rlflow: rlflow's log-prob head is always fused and chunked" in text
    assert "impl_backend='triton' has no effect in rlflow" in text


def test_override_optimizer_config_with_fsdp(tiny):
    key = f"+{OPT}.override_optimizer_config"
    p = plan(tiny, f"{key}.eps=1e-5", f"{key}.amsgrad=true")
    opt = p.trainer_kwargs["optimizer"]([torch.nn.Parameter(torch.zeros(2))])
    assert (opt.defaults["eps"], opt.defaults["amsgrad"], opt.defaults["lr"]) == (1e-5, True, 1e-6)
    with pytest.raises(ConfigError, match=r"override_optimizer_config.bogus: torch.optim.AdamW takes no argument"):
        plan(tiny, f"{key}.bogus=1")
    megatron = plan(tiny, f"{key}.optimizer_cpu_offload=true", f"{key}.overlap_cpu_optimizer_d2h_h2d=true")
    text = notes(megatron)
    assert "optimizer_cpu_offload=True: rlflow's optimizer offload" in text and "CPU memory" in text
    assert "overlap_cpu_optimizer_d2h_h2d': True} are megatron-core OptimizerConfig fields" in text
    assert "eps" not in megatron.trainer_kwargs["optimizer"].keywords
