"""The component-tree recipes in recipes/tree: each passes ``--dry-run`` and builds the run its twin in the short
verl-key format (recipes/yaml) builds, so the two cannot drift apart.

"The same run" is checked on the trees: the short recipe's (``rlflow.config.verl.tree.verl_tree`` of its plan, what
``--config recipes/yaml/X.yaml`` builds) and the tree recipe's, both with every ``_target_`` resolved to the callable
it names and every argument left out filled with its default. The few spellings that differ and build the same
objects are put one way first (``same_spelling``: each with the reason it is the same); the run folders differ on
purpose (``runs/tree/X``, ``runs/yaml/X``). One pair also trains a step each and logs the same metrics."""

import copy
import importlib.util
import inspect
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.config import components, make_plan
from rlflow.config.components_run import train as train_tree
from rlflow.config.components import DATA, GROUP_TARGETS, KEYWORDS, NAMER_PATHS, TRAINER, locate, named
from rlflow.config.verl.native import load_native
from rlflow.config.verl.resolve import init_parameters
from rlflow.config.verl.run import train as train_short
from rlflow.config.verl.tree import defaults_of, verl_tree
from rlflow.trainer.options import Batching, Loop, Optim

ROOT = Path(__file__).resolve().parents[2]
TREES, SHORT = ROOT / "recipes" / "tree", ROOT / "recipes" / "yaml"
TWINS = sorted(p.stem for p in SHORT.glob("*.yaml"))
TIMING = ("timing_s/", "perf/")  # wall-clock figures: the one thing two equal runs do not share
GREEDY = {"n": 1, "do_sample": False, "temperature": 1.0}  # Loop(val_n=1)'s validation sampling


def paths(model_dir, data_dir) -> list[str]:
    """The same overrides in both formats (their keys coincide): the tiny model and data instead of runs/task."""
    return [f"policy.path={model_dir}", f"data.train={data_dir}/train.parquet", f"data.val={data_dir}/test.parquet"]


def short_tree(name: str, overrides: list[str]) -> dict:
    plan = make_plan(load_native(SHORT / f"{name}.yaml", overrides))
    made = verl_tree(plan, plan.total_training_steps)
    assert not made.deferred, made.deferred
    return made.tree


def field(node: dict, cls, name: str):
    return node.get(name, getattr(cls, name))


def same_spelling(tree: dict) -> dict:
    """``tree`` with the spellings that build the same objects put one way, and the run folder left out."""
    tree = copy.deepcopy(tree)
    for arg, target in GROUP_TARGETS.items():  # a group left out is the group's defaults
        tree.setdefault(arg, {"_target_": target})
    optim, batching, loop = tree["optim"], tree["batching"], tree["loop"]
    adamw = optim.get("optimizer")  # the verl path's AdamW with the group's lr and weight decay is the Trainer's own
    if (isinstance(adamw, dict) and adamw.get("_target_") == "torch.optim.AdamW" and adamw.get("_partial_")
            and adamw.get("lr") == field(optim, Optim, "lr")
            and adamw.get("weight_decay") == field(optim, Optim, "weight_decay")
            and list(adamw.get("betas", [0.9, 0.999])) == [0.9, 0.999]
            and set(adamw) <= {"_target_", "_partial_", "lr", "weight_decay", "betas"}):
        del optim["optimizer"]
    schedule = field(optim, Optim, "lr_schedule")  # the Trainer reads a name as Schedule(name)
    if isinstance(schedule, str):
        optim["lr_schedule"] = {"_target_": "rlflow.trainer.schedule.Schedule", "kind": schedule}
    if field(batching, Batching, "mini_batch_size") is None:  # one update per step: the mini-batch is the batch
        batching["mini_batch_size"] = field(batching, Batching, "batch_size")
    sampling = field(loop, Loop, "val_sampling")  # greedy with its top-p/top-k at their no-op values: val_n=1's
    if sampling is not None and field(loop, Loop, "val_n") == 1 and (
            {k: sampling.get(k) for k in GREEDY} == GREEDY and sampling.get("top_p", 1.0) == 1.0
            and sampling.get("top_k", -1) == -1 and set(sampling) <= {*GREEDY, "top_p", "top_k"}):
        loop["val_sampling"] = None
    loop.pop("progress", None)  # the progress bar: what the terminal shows, not what trains
    tree["run"].pop("path", None)  # on purpose: runs/tree/<name> and runs/yaml/<name>
    tree[DATA].pop("image_patch_size", None)  # resizes images; these prompts have none
    return _without_reward_names(tree)


def _without_reward_names(value):
    """FunctionReward's ``name`` only words its messages (a single reward's metrics do not carry it)."""
    if isinstance(value, list):
        return [_without_reward_names(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _without_reward_names(v) for k, v in value.items()}
    if out.get("_target_") == "rlflow.FunctionReward":
        out.pop("name", None)
    return out


def canonical(value, where: str = ""):
    """A comparable form of a tree: each node as (callable, partial?, positional args, every keyword argument with
    the callable's defaults filled in); lists and tuples alike."""
    if isinstance(value, dict) and "_target_" in value:
        if value["_target_"] in NAMER_PATHS:
            return "object", named(value["path"], f"{where}.path")
        target = locate(value["_target_"], f"{where}._target_")
        partial = bool(value.get("_partial_", False))
        args = {k: canonical(v, f"{where}.{k}") for k, v in value.items() if k not in KEYWORDS}
        for name, default in ({} if partial else defaults(target)).items():
            args.setdefault(name, canonical(default, f"{where}.{name}"))
        return target, partial, canonical(value.get("_args_", []), where), args
    if isinstance(value, dict):
        return {k: canonical(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v, f"{where}[{i}]") for i, v in enumerate(value))
    return str(value) if isinstance(value, Path) else value


def defaults(target) -> dict:
    """The callable's defaults; a class's ``**kwargs`` forwarded to its base (GSPOLoss to PPOLoss) count too."""
    if inspect.isclass(target):
        return {n: p.default for n, p in init_parameters(target).items() if p.default is not p.empty}
    return defaults_of(target)


def run_of(tree: dict):
    """The Trainer's node and the data's, canonical."""
    tree = same_spelling(tree)
    root = {"_target_": TRAINER, **{k: v for k, v in tree.items() if k != DATA}}
    return canonical(root), canonical(tree[DATA], DATA)


def test_every_short_recipe_has_a_tree_twin():
    assert sorted(p.stem for p in TREES.glob("*.yaml")) == sorted([*TWINS, "default_job"])


NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[NEEDS_VLLM] if "vllm" in n else []) for n in TWINS])
def test_the_tree_recipe_builds_the_run_its_short_twin_builds(name, model_dir, data_dir):
    overrides = paths(model_dir, data_dir) + ([f"critic.path={model_dir}"] if name == "ppo" else [])
    mine = components.load(TREES / f"{name}.yaml", overrides)
    theirs = short_tree(name, overrides)
    assert mine["run"]["path"] == f"runs/tree/{name}" and theirs["run"]["path"] == f"runs/yaml/{name}"
    (my_trainer, my_data), (their_trainer, their_data) = run_of(mine), run_of(theirs)
    assert my_data == their_data
    for arg in sorted(set(my_trainer[3]) | set(their_trainer[3])):
        assert my_trainer[3].get(arg) == their_trainer[3].get(arg), arg
    assert my_trainer == their_trainer


@pytest.mark.parametrize("name", TWINS)
def test_the_tree_recipe_reads_the_files_its_short_twin_reads(name, monkeypatch):
    """Tree paths are relative to where it runs (as Python's): from the repository root, the files the short recipe
    names relative to its own folder (``../../runs/task``)."""
    monkeypatch.chdir(ROOT)
    tree, short = components.load(TREES / f"{name}.yaml"), load_native(SHORT / f"{name}.yaml")
    pairs = {"policy": ("actor_rollout_ref.model.path", tree["policy"]["path"]),
             "data.train": ("data.train_files", tree[DATA]["train"]), "data.val": ("data.val_files", tree[DATA]["val"])}
    if "critic" in tree:
        pairs["critic"] = ("critic.model.path", tree["critic"]["path"])
    for where, (key, mine) in pairs.items():
        assert Path(mine).resolve() == Path(short[key]).resolve(), where


@pytest.mark.parametrize("name", [*TWINS, "default_job"])
def test_every_tree_recipe_passes_the_dry_run(name, capsys):
    assert main(["train", str(TREES / f"{name}.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "is valid. The Python it builds" in out and out.rstrip().endswith("history = trainer.fit(data)")


def test_the_grpo_twins_train_a_step_alike(model_dir, data_dir, tmp_path):
    """One step of each, from the same small overrides: the same metrics, every one but the timings."""
    common = paths(model_dir, data_dir) + ["rollout.n=2", "loop.max_steps=1"]
    tree_history = train_tree(TREES / "grpo.yaml", [
        *common, "batching.batch_size=4", "batching.mini_batch_size=2", "loop.val_every=0",
        f"run.path={tmp_path / 'tree'}", "run.loggers=[]", "run.resume=null"])
    short = [*paths(model_dir, data_dir), "rollout.n=2", "trainer.max_steps=1", "trainer.batch_size=4",
             "trainer.mini_batch_size=2", "trainer.val_every=0", "trainer.val_before_train=false",
             f"trainer.run_dir={tmp_path / 'short'}", "trainer.loggers=[]", "trainer.resume=disable"]
    short_history = train_short(make_plan(load_native(SHORT / "grpo.yaml", short)))
    keep = (lambda m: {k: v for k, v in m.items() if not k.startswith(TIMING)})
    assert [keep(m) for m in tree_history] == [keep(m) for m in short_history]
    assert len(tree_history) == 1 and "actor/pg_loss" in tree_history[0]


def test_the_recipes_page_shows_the_grpo_recipe_as_it_is():
    body = "\n".join(line for line in (TREES / "grpo.yaml").read_text().splitlines() if not line.startswith("#"))
    assert f"```yaml\n{body}\n```" in (ROOT / "docs" / "recipes.md").read_text()
