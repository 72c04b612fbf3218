"""Component-tree recipes (rlflow.config.components): ``rlflow train TREE.yaml`` builds and trains, every problem comes
back at once naming its path, ``--dry-run`` prints Python that builds the same objects, a user's class plugs in by
file or import path, and the default job's tree trains exactly as ``rlflow train`` does."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from rlflow.cli import main
from rlflow.config import components
from rlflow.config.errors import ConfigError
from rlflow.tasks.default_job import build_trainer
from rlflow.trainer.main_ppo import main as main_ppo

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TREE = ROOT / "recipes" / "tree" / "default_job.yaml"
TIMING = ("timing_s/", "perf/")  # wall-clock figures: the one thing two equal runs do not share


@pytest.fixture
def tree_file(model_dir, data_dir, tmp_path):
    """A tree of the tiny model and parquet files: one GRPO step of 4 prompts x 2 samples."""
    path = tmp_path / "tree.yaml"
    path.write_text(f"""
policy: {{_target_: rlflow.Policy.from_pretrained, path: {model_dir}}}
rollout: {{_target_: rlflow.HFRollout, n: 2, max_new_tokens: 4}}
reward:
  _target_: rlflow.FunctionReward
  fn: {{_target_: hydra.utils.get_method, path: rlflow.rewards.default_compute_score}}
estimator: {{_target_: rlflow.GRPO}}
loss: {{_target_: rlflow.PPOLoss, clip_ratio: 0.2}}
optim: {{lr: 1.0e-3}}
batching: {{batch_size: 4, mini_batch_size: 2}}
loop: {{max_steps: 1, progress: false}}
run: {{path: {tmp_path / "run"}, loggers: [jsonl]}}
data: {{_target_: rlflow.PromptData, train: {data_dir}/train.parquet, val: {data_dir}/test.parquet}}
""")
    return path


def test_rlflow_train_on_a_tree_trains_and_keeps_the_resolved_tree(tree_file, tmp_path, capsys):
    assert main(["train", str(tree_file), "loss.clip_ratio=0.3"]) == 0
    assert "[rlflow] 1 RL step (GRPO) in" in capsys.readouterr().out
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and "actor/pg_loss" in json.loads(rows[0])
    kept = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert kept["loss"] == {"_target_": "rlflow.PPOLoss", "clip_ratio": 0.3}
    assert kept["optim"]["_target_"] == "rlflow.Optim"  # the group's _target_, filled in


def test_the_dry_run_prints_python_that_builds_what_the_tree_builds(tree_file, capsys):
    assert main(["train", "--config", str(tree_file), "--dry-run"]) == 0
    code = capsys.readouterr().out.split("(nothing was built):\n", 1)[1]
    assert "trainer = Trainer(\n    policy=Policy.from_pretrained(path=" in code
    assert "reward=FunctionReward(fn=default_compute_score)" in code and "optim=Optim(lr=0.001)" in code
    assert code.rstrip().endswith("history = trainer.fit(data)")
    printed: dict = {}
    exec(compile(code.replace("history = trainer.fit(data)", ""), "dry-run", "exec"), printed)  # noqa: S102
    trainer, data = components.build(components.load(tree_file), tree_file.parent)
    mine = printed["trainer"]
    for role in ("policy", "rollout", "reward", "estimator", "loss"):
        assert type(getattr(mine, role)) is type(getattr(trainer, role)), role
    assert (mine.optim, mine.batching, mine.loop, mine.run) == (trainer.optim, trainer.batching, trainer.loop, trainer.run)
    assert mine.loss.clip_ratio == trainer.loss.clip_ratio and mine.rollout.n == trainer.rollout.n == 2
    assert mine.reward.fn is trainer.reward.fn
    for (name, a), (_, b) in zip(mine.policy.model.state_dict().items(), trainer.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert [r["prompt"] for r in printed["data"].train] == [r["prompt"] for r in data.train]


def test_every_problem_comes_back_at_once_naming_its_path_before_anything_loads(tree_file, capsys):
    """The policy's folder does not exist: the tree's problems are found without loading it."""
    assert main(["train", str(tree_file), "policy.path=/no/such/model", "loss.clip_ratoi=0.3", "lr=0.1",
                 "+batching.epochs=2", "estimator._target_=rlflow.GRPOO", "reward.fn.path=rlflow.rewards.no_such_fn",
                 "+stages=[{_target_: rlflow.rollout.stream.FilterGroups, _partail_: true}]", "~data"]) == 2
    err = capsys.readouterr().err
    assert "7 problems in the config" in err, err
    for text in ["loss.clip_ratoi: not a parameter of rlflow.PPOLoss (did you mean clip_ratio?)",
                 "lr: not a parameter of rlflow.Trainer (the recipe's root) (it belongs in its group: optim: {lr: ...})",
                 "batching.epochs: not a parameter of rlflow.Batching (did you mean ppo_epochs?)",
                 "estimator._target_: rlflow has no 'GRPOO' (did you mean rlflow.GRPO?)",
                 "reward.fn.path: rlflow.rewards has no 'no_such_fn'",
                 "stages[0]._partail_: not a Hydra keyword",
                 "data: missing: the prompts fit trains on"]:
        assert text in err, text
    assert "/no/such/model" not in err


def test_a_users_class_by_file_or_import_path_needs_no_config_code(tree_file, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_parts.py").write_text(
        "from rlflow import PPOLoss\n\n\nclass ScaledLoss(PPOLoss):\n"
        "    def __init__(self, scale: float, clip_ratio: float = 0.2):\n"
        "        super().__init__(clip_ratio=clip_ratio)\n        self.scale = scale\n")
    by_file = components.load(tree_file, ["loss={_target_: 'my_parts.py:ScaledLoss', scale: 0.5}"])
    trainer, _ = components.build(by_file, tree_file.parent)  # the file is found next to the recipe
    assert type(trainer.loss).__name__ == "ScaledLoss" and trainer.loss.scale == 0.5
    assert main(["train", str(tree_file), "--dry-run", "loss={_target_: 'my_parts.py:ScaledLoss', scale: 0.5}"]) == 0
    out = capsys.readouterr().out
    assert f"ScaledLoss = load_object({str(tmp_path / 'my_parts.py')!r}, 'ScaledLoss', 'loss._target_')" in out
    assert "loss=ScaledLoss(scale=0.5)" in out
    monkeypatch.syspath_prepend(str(tmp_path))
    missing = components.check(components.load(tree_file, ["loss={_target_: my_parts.ScaledLoss}"]))
    assert [str(p) for p in missing] == ["loss.scale: missing: a required argument of my_parts.ScaledLoss"]


def test_overrides_add_replace_and_delete_keys(tree_file):
    tree = components.load(tree_file, ["+loop.val_n=2", "~loop.progress", "rollout.n=4", "rollout._target_=rlflow.HFRollout"])
    assert tree["loop"] == {"_target_": "rlflow.Loop", "max_steps": 1, "val_n": 2} and tree["rollout"]["n"] == 4
    with pytest.raises(ConfigError, match="an override is key=value"):
        components.load(tree_file, ["loop.max_steps"])
    with pytest.raises(ConfigError, match="~loop.nothing: loop.nothing is not in the recipe"):
        components.load(tree_file, ["~loop.nothing"])


def test_only_trees_take_the_tree_path():
    """verl's YAML has _target_ nodes of its own and native recipes none: both keep their path."""
    yamls = [*ROOT.glob("recipes/**/*.yaml"), *ROOT.glob("examples/**/*.yaml"),
             *(ROOT / "src/rlflow/config/verl").rglob("*.yaml")]
    assert len(yamls) > 30
    assert sorted(p for p in yamls if components.is_tree_file(p)) == sorted(DEFAULT_TREE.parent.glob("*.yaml"))


def test_the_verl_entry_point_dry_runs_a_tree_too(capsys):
    assert main_ppo(["--config", str(DEFAULT_TREE), "--dry-run", "loop.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "loop=Loop(max_steps=3, val_every=40, seed=0)" in out and "policy=warm_started_policy(seed=0)" in out


def test_the_default_jobs_tree_trains_as_the_default_job(tmp_path):
    """Two steps (validating after each, as ``rlflow train --steps 2`` does) from the shipped seed-0 warm start: the
    tree's metrics equal those of the default job's own builder, every one but the timings."""
    trainer, data = build_trainer(seed=0, steps=2, run_dir=tmp_path / "default", progress=False, val_every=1)
    overrides = ["loop.max_steps=2", "loop.val_every=1", "loop.progress=false", f"run.path={tmp_path / 'default'}"]
    tree_trainer, _ = components.build(components.load(DEFAULT_TREE, overrides))  # what fit does not show on-policy
    assert (tree_trainer.optim, tree_trainer.batching, tree_trainer.loop, tree_trainer.run.loggers) == \
           (trainer.optim, trainer.batching, trainer.loop, trainer.run.loggers)
    assert (tree_trainer.loss.clip_ratio, tree_trainer.rollout.n, tree_trainer.rollout.max_new_tokens) == \
           (trainer.loss.clip_ratio, trainer.rollout.n, trainer.rollout.max_new_tokens)
    assert tree_trainer.reward.fn is trainer.reward.fn
    expected = trainer.fit(data)
    assert main(["train", str(DEFAULT_TREE), *overrides[:-1], f"run.path={tmp_path / 'tree'}"]) == 0
    got = [json.loads(line) for line in (tmp_path / "tree" / "metrics.jsonl").read_text().splitlines()]
    assert len(got) == len(expected) == 2
    for mine, theirs in zip(got, expected):
        assert any(k.startswith("val-core/") for k in mine)
        assert {k: v for k, v in mine.items() if not k.startswith(TIMING) and k != "step"} == \
               {k: v for k, v in theirs.items() if not k.startswith(TIMING)}


def test_the_pages_tree_and_python_are_the_recipe_and_its_dry_run(capsys):
    """docs/config-tree.md shows recipes/tree/default_job.yaml and its dry run as they are (tests/test_docs.py runs
    both blocks)."""
    page = (ROOT / "docs" / "config-tree.md").read_text()
    recipe = "".join(line for line in DEFAULT_TREE.read_text().splitlines(keepends=True) if not line.startswith("#"))
    assert f"```yaml\n{recipe}```" in page
    assert main(["train", str(DEFAULT_TREE), "--dry-run"]) == 0
    code = capsys.readouterr().out.split("(nothing was built):\n\n", 1)[1]
    assert f"```python\n{code.rstrip()}\n```" in page


def test_a_default_job_flag_with_a_tree_names_the_trees_key(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", str(DEFAULT_TREE), "--steps", "3"])
    assert exc.value.code == 2
    assert "--steps belongs to the default job; with a config, use loop.max_steps=N" in capsys.readouterr().err
