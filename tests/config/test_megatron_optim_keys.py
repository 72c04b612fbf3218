"""verl's Megatron optimizer keys (lr_decay_style, lr_warmup_init, min_lr, WSD, weight_decay_incr_style) and
optim.optimizer_impl through the verl entry point.

Expected learning rates and weight decays come from megatron-core's own ``OptimizerParamScheduler`` (the class
verl's Megatron workers step), driven here step by step; the optimizer module is one this test writes.
"""

import sys

import pytest
import torch

from rlflow.config import ConfigError
from rlflow.config.verl.run import unused_notes
from rlflow.trainer.main_ppo import main
from rlflow.trainer.schedule import ParamSchedule, make_scheduler
from tests.config.test_main_ppo import steps
from tests.config.test_optim_keys import A, C, OPT, no_gpus, plan  # noqa: F401  (no_gpus: an autouse fixture)


def megatron(steps, lr=1.0, init=0.0, min_lr=0.0, warmup=0, decay=None, style="constant", wsd=None,
             wsd_style="exponential", wd=(0.0, 0.0), wd_style="constant"):
    """(lr, weight decay) at steps 0..steps-1 from megatron-core's scheduler, stepped once per step as verl does
    (skipped where megatron-core is not installed: it comes with the `megatron` extra)."""
    OptimizerParamScheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler").OptimizerParamScheduler
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = OptimizerParamScheduler(opt, init_lr=init, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
                                    lr_decay_steps=decay or steps, lr_decay_style=style, start_wd=wd[0], end_wd=wd[1],
                                    wd_incr_steps=steps, wd_incr_style=wd_style, use_checkpoint_opt_param_scheduler=False,
                                    override_opt_param_scheduler=True, wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)
    out = []
    for _ in range(steps):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
        sched.step(1)
    return out


def rlflow(schedule, steps, warmup=0, lr=1.0, wd=0.01):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr, weight_decay=wd)
    sched = make_scheduler(opt, schedule, warmup, steps)
    out = []
    for _ in range(steps):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("style, warmup, init, min_lr, decay, wsd, wsd_style", [
    ("constant", 3, 0.2, 0.0, None, None, "exponential"), ("linear", 2, 0.0, 0.1, None, None, "exponential"),
    ("cosine", 3, 0.1, 0.05, 10, None, "exponential"), ("inverse-square-root", 4, 0.0, 0.2, None, None, "exponential"),
    ("WSD", 2, 0.0, 0.1, None, 5, "exponential"), ("WSD", 0, 0.0, 0.0, 9, 4, "cosine"),
    ("WSD", 1, 0.3, 0.0, None, 3, "linear"), ("WSD", 1, 0.0, 0.1, None, 6, "minus_sqrt"), ("linear", 0, 0.0, 0.0, 6, None, "linear")])
def test_lr_equals_megatron_cores_scheduler(style, warmup, init, min_lr, decay, wsd, wsd_style):
    lr, n = 2e-3, 12
    got = rlflow(ParamSchedule(style, init, min_lr, decay, wsd, wsd_style), n, warmup, lr=lr)
    want = megatron(n, lr, init * lr, min_lr * lr, warmup, decay, style, wsd, wsd_style)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-12, abs=1e-15)
    assert len({round(g[0], 12) for g in got}) > 2 or style == "constant"  # the schedule moves


@pytest.mark.parametrize("wd_style", ["linear", "cosine"])
def test_weight_decay_increment_equals_megatron_cores(wd_style):
    got = rlflow(ParamSchedule(weight_decay_style=wd_style, start_weight_decay=0.01, end_weight_decay=0.1), 8)
    want = megatron(8, wd=(0.01, 0.1), wd_style=wd_style)
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], rel=1e-12)
    assert got[0][1] == pytest.approx(0.01) and got[-1][1] > 0.08
    with pytest.raises(ValueError, match="start_weight_decay == end_weight_decay"):
        ParamSchedule(start_weight_decay=0.0, end_weight_decay=0.1)


def test_lr_decay_style_through_main_ppo_sets_every_steps_lr(tiny, capsys):
    """6 steps, linear decay to min_lr after 2 warm-up steps from lr_warmup_init: actor/lr of step s is
    megatron-core's lr after s - 1 scheduler steps."""
    lr = 1e-3
    assert main(tiny + [f"{OPT}.lr={lr}", f"{OPT}.lr_decay_style=linear", f"{OPT}.lr_warmup_init=2e-4",
                        f"{OPT}.min_lr=1e-4", f"{OPT}.lr_warmup_steps=2", "trainer.total_training_steps=6",
                        "trainer.val_before_train=false"]) == 0
    logged = steps(capsys.readouterr().out)
    want = [x[0] for x in megatron(6, lr, 2e-4, 1e-4, 2, None, "linear")]
    assert [logged[s]["actor/lr"] for s in range(1, 7)] == pytest.approx(want, rel=1e-6)
    assert want[0] == pytest.approx(2e-4) and want[-1] < lr  # starts above 0, decays


def test_schedule_keys_reach_the_plan(tiny, model_dir):
    s = plan(tiny, f"{OPT}.lr=1e-4", f"{OPT}.lr_decay_style=WSD", f"{OPT}.lr_wsd_decay_steps=3",
             f"{OPT}.lr_wsd_decay_style=cosine", f"{OPT}.lr_decay_steps=10", f"{OPT}.min_lr=1e-5").trainer_kwargs[
        "lr_schedule"]
    assert (s.decay_style, s.decay_steps, s.wsd_decay_steps, s.wsd_style) == ("WSD", 10, 3, "cosine")
    assert s.min_lr_ratio == pytest.approx(0.1)
    p = plan(tiny, "algorithm.adv_estimator=gae", f"critic.model.path={model_dir}", f"{OPT}.lr=1e-4",
             f"{C}.optim.lr=1e-3", f"{OPT}.lr_warmup_init=5e-5", f"{OPT}.weight_decay_incr_style=cosine")
    s, text = p.trainer_kwargs["lr_schedule"], "\n".join([*p.notes, *unused_notes(p.cfg)])
    assert s.init_lr_ratio == pytest.approx(0.5) and s.weight_decay_style == "cosine"
    assert "critic uses the same fraction of its own lr (0.0005)" in text
    assert "as in verl, which passes start_wd = end_wd = optim.weight_decay to megatron-core" in text
    assert isinstance(plan(tiny).trainer_kwargs["lr_schedule"], type(plan(tiny).trainer_kwargs["lr_schedule"]))
    assert not isinstance(plan(tiny).trainer_kwargs["lr_schedule"], ParamSchedule)  # defaults: verl's FSDP schedule
    with pytest.raises(ConfigError, match="lr_decay_style=WSD needs .*lr_wsd_decay_steps"):
        plan(tiny, f"{OPT}.lr_decay_style=WSD")
    with pytest.raises(ConfigError, match="two schedules"):
        plan(tiny, f"{OPT}.lr_decay_style=cosine", f"{OPT}.lr_scheduler_type=cosine")
    with pytest.raises(ConfigError, match=r"lr_warmup_init=0.01: must be in \[0, optim.lr"):
        plan(tiny, f"{OPT}.lr_warmup_init=0.01")
    with pytest.raises(ConfigError, match="lr_decay_style='exp': choose from"):
        plan(tiny, f"{OPT}.lr_decay_style=exp")


def test_the_other_schedules_floor_says_it_is_unused(tiny):
    p = plan(tiny, f"{OPT}.min_lr=1e-7")
    assert "min_lr=1e-07 has no effect in rlflow: only used with Megatron's schedule" in "\n".join(unused_notes(p.cfg))
    p = plan(tiny, f"{OPT}.lr_decay_style=linear", f"{OPT}.min_lr_ratio=0.1")
    assert "min_lr_ratio=0.1 is not used: it is the floor of verl's FSDP cosine" in "\n".join(p.notes)


def test_optimizer_impl_imports_the_class_from_a_users_module(tiny, tmp_path, monkeypatch):
    (tmp_path / "my_optims.py").write_text(
        "import torch\n"
        "class HalfAdamW(torch.optim.AdamW):\n"
        "    pass\n"
        "NotAnOptimizer = dict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_optims", raising=False)
    p = plan(tiny, f"{OPT}.optimizer_impl=my_optims", f"{OPT}.optimizer=HalfAdamW", f"{OPT}.lr=3e-4")
    opt = p.trainer_kwargs["optimizer"]([torch.nn.Parameter(torch.zeros(2))])
    assert type(opt).__name__ == "HalfAdamW" and opt.defaults["lr"] == 3e-4
    assert type(plan(tiny, f"{OPT}.optimizer_impl=torch.optim", f"{OPT}.optimizer=SGD", f"{OPT}.betas=[0.9,0.99]")
                .trainer_kwargs["optimizer"].func) is type
    with pytest.raises(ConfigError, match="optimizer_impl='no_such_mod': cannot import it"):
        plan(tiny, f"{OPT}.optimizer_impl=no_such_mod")
    with pytest.raises(ConfigError, match="optimizer='NotAnOptimizer': my_optims is not a torch.optim.Optimizer"):
        plan(tiny, f"{OPT}.optimizer_impl=my_optims", f"{OPT}.optimizer=NotAnOptimizer")
    with pytest.raises(ConfigError, match="optimizer='Missing': my_optims has no such class"):
        plan(tiny, f"{OPT}.optimizer_impl=my_optims", f"{OPT}.optimizer=Missing")
