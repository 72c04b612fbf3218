"""A verl command is a component tree (rlflow.config.verl.tree): its ``--dry-run`` prints the tree as Python, and that
Python, run as printed, trains exactly as the command does (every metric but the timings)."""

import json

import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import components, load_config, make_plan
from rlflow.config.verl.build import build_data, build_trainer, load_tokenizer, total_steps
from rlflow.config.verl.tree import verl_tree
from rlflow.trainer.main_ppo import main
from tests.config.test_data_user_keys import DATASET

TIMING = ("timing_s/", "perf/")  # wall-clock figures: the one thing two equal runs do not share
HEADER = "(rlflow.config.verl.tree):\n\n"
END = "history = trainer.fit(data)\n"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def printed_python(argv, capsys) -> str:
    assert main(argv + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Not said by the tree yet" not in out  # the tree says every part of the run
    return out.split(HEADER, 1)[1].split(END, 1)[0] + END


CASES = {
    "grpo": [],
    "ppo_with_a_critic": ["algorithm.adv_estimator=gae", "critic.model.path={model}", "critic.ppo_mini_batch_size=2"],
    "remax_with_kl_in_reward": ["algorithm.adv_estimator=remax", "algorithm.use_kl_in_reward=true"],
    "on_policy_distillation": ["distillation.enabled=True", "distillation.teacher_models.teacher_model.model_path={model}",
                               "distillation.distillation_loss.loss_mode=k1",
                               "distillation.distillation_loss.use_policy_gradient=True",
                               "distillation.distillation_loss.use_task_rewards=False"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_printed_python_trains_as_the_verl_command(case, tiny, model_dir, tmp_path, capsys):
    keys = tiny + [k.format(model=model_dir) for k in CASES[case]] + ["trainer.val_before_train=false",
                                                                      "trainer.test_freq=1"]
    run = tmp_path / "run"  # the tiny keys' trainer.default_local_dir
    code = printed_python(keys, capsys)
    assert "trainer = Trainer(\n    policy=Policy.from_pretrained(path=" in code
    assert main(keys) == 0
    expected = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    program: dict = {}
    code = code.replace(repr(str(run)), repr(str(tmp_path / "python")))  # its own run folder
    exec(compile(code, "dry-run", "exec"), program)  # noqa: S102
    got = program["history"]
    assert len(got) == len(expected) == 2 and any(k.startswith("val-core/") for k in got[0])
    for mine, theirs in zip(got, expected):
        assert {k: v for k, v in mine.items() if not k.startswith(TIMING)} == \
               {k: v for k, v in theirs.items() if not k.startswith(TIMING) and k != "step"}


def test_the_tree_checks_and_builds_as_a_tree_recipe(tiny, model_dir, capsys):
    """The same tree through rlflow.config.components: no problem, and the modules of the command's chain."""
    plan = make_plan(load_config(tiny + CASES["remax_with_kl_in_reward"]))
    made = verl_tree(plan, total_steps(plan, build_data(plan, load_tokenizer(plan))))
    assert made.deferred == [] and components.check(made.tree) == []
    # ReMax's greedy pass: a stage on the run's rollout, scored by a reward of its own (the same node again)
    assert made.tree["stages"] == [{"_target_": "rlflow.algorithms.GreedyBaseline", "reward": made.tree["reward"]}]
    assert made.tree["estimator"]["_args_"][0]["controller"] == {"_target_": "rlflow.algorithms.FixedKLController"}
    trainer, data = components.build(made.tree)
    assert [type(m).__name__ for m in trainer.estimator.modules] == ["KLInReward", "ReMax"]
    assert len(data.train) == 12


def test_the_reference_split_is_a_node_and_what_the_tree_cannot_say_yet_is_listed(tiny, tmp_path, capsys):
    """The reference's own scoring split is a node (a partial of frozen_reference the Trainer calls with its policy),
    and the run builds it from there; a user's dataset class reads the files with the policy's tokenizer, which no
    constructor argument says yet: the dry run lists it. A custom chat template is Policy.from_pretrained's argument."""
    ref = ["data.max_prompt_length=48", "actor_rollout_ref.actor.use_kl_loss=true",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
           "+actor_rollout_ref.model.custom_chat_template='{{ messages }}'"]
    assert main(tiny + ["--dry-run", *ref]) == 0
    out = capsys.readouterr().out
    assert "Not said by the tree yet" not in out
    assert "reference=functools.partial(frozen_reference, micro_batch_size=2, max_tokens_per_micro_batch=None)" in out
    assert "chat_template='{{ messages }}'" in out
    trainer, _ = build_trainer(make_plan(load_config(tiny + ref)))
    assert trainer.reference.micro_batch_size == 2 and trainer.policy.micro_batch_size != 2
    (tmp_path / "my_dataset.py").write_text(DATASET)
    assert main(tiny + ["--dry-run", f"data.custom_cls.path={tmp_path}/my_dataset.py",
                        "data.custom_cls.name=ReversedQuestions"]) == 0
    out = capsys.readouterr().out
    assert "Not said by the tree yet" in out and "data: data.custom_cls reads the files" in out


def test_the_run_builds_what_the_tree_says(tiny, monkeypatch):
    """The verl run instantiates the tree (one path): a node changed in the tree is what the built Trainer holds."""
    import rlflow.config.verl.build as build

    plan = make_plan(load_config(tiny))
    written = build.verl_tree

    def edited(plan, total):
        made = written(plan, total)
        made.tree["loss"]["clip_ratio"] = 0.123
        return made

    monkeypatch.setattr(build, "verl_tree", edited)
    trainer, _ = build_trainer(plan)
    assert trainer.loss.clip_ratio == 0.123
