"""verl's distillation.* through the entry point: the teacher stage and the loss it builds, several teachers routed
by data_source (verl's MOPD), what is refused and why, and a run that trains with it."""

import json

import pandas as pd
import pytest

from rlflow.algorithms import PPOLoss
from rlflow.algorithms.distillation import DistillationLoss, PolicyGradientDistillationLoss
from rlflow.config.verl.build import build_trainer
from rlflow.config.verl.loading import ConfigError, NotSupportedError, load_config
from rlflow.config.verl.plan import make_plan
from rlflow.config.verl.run import main
from rlflow.models.teacher import Teacher
from rlflow.models.tiny import char_tokenizer, tiny_qwen2
from tests.config.conftest import CHAT_TEMPLATE, verl_rows
from tests.config.test_vision_config import overrides as vision_overrides, vlm_files  # noqa: F401 (a fixture)

D, L = "distillation", "distillation.distillation_loss"
# the distillation block of verl's examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh (its defaults)
SCRIPT = [f"{D}.enabled=True", f"{D}.n_gpus_per_node=4", f"{D}.nnodes=1",
          f"{D}.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
          f"{D}.teacher_models.teacher_model.inference.name=vllm",
          f"{L}.loss_mode=k1", f"{L}.topk=64", f"{L}.use_task_rewards=False", f"{L}.use_policy_gradient=True",
          f"{L}.loss_max_clamp=10.0", f"{L}.log_prob_min_clamp=-10.0"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny model with the student's tokenizer (another seed)."""
    path = tmp_path_factory.mktemp("teacher")
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def single(teacher_dir):
    return SCRIPT + [f"{D}.teacher_models.teacher_model.model_path={teacher_dir}"]


def test_a_verl_script_trains_with_its_teacher(tiny, teacher_dir, tmp_path, capsys):
    assert main(tiny + single(teacher_dir) + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"stages=[Teacher.from_pretrained(paths={str(teacher_dir)!r}, remove_padding=True)]" in out
    assert "loss=PolicyGradientDistillationLoss(max_clamp=10.0" in out  # kind='k1', coef=1.0, rl_loss=None: defaults
    assert f"{D}.teacher_models.teacher_model.inference.name='vllm' has no effect in rlflow" in out
    assert main(tiny + single(teacher_dir) + ["trainer.logger=[console,file]"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distillation/loss" in r]
    assert len(steps) == 2 and all("timing_s/teacher" in r and "distillation/teacher_kl" in r for r in steps)
    assert all("distillation/pg_clipfrac" in r and "actor/pg_loss" not in r for r in steps)  # no task reward term


def test_with_task_rewards_the_policy_loss_gets_the_distillation_term(tiny, teacher_dir):
    cfg = load_config(tiny + single(teacher_dir) + [f"{L}.use_task_rewards=True", f"{L}.distillation_loss_coef=0.3",
                                                    f"{L}.use_policy_gradient=False", f"{L}.loss_mode=k3",
                                                    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"])
    trainer, _ = build_trainer(make_plan(cfg))
    loss = trainer.loss
    assert type(loss) is DistillationLoss and isinstance(loss.rl_loss, PPOLoss)
    assert (loss.kind, loss.coef, loss.max_clamp, loss.agg) == ("k3", 0.3, 10.0, "seq-mean-token-mean")
    assert [s.name for s in trainer.experience.stages] == ["teacher"]


def test_several_teachers_are_routed_by_data_source(tiny, model_dir, teacher_dir, tmp_path):
    data = tmp_path / "two.parquet"
    pd.DataFrame(verl_rows(2, "train", 0) + verl_rows(2, "train", 1, "lighteval/MATH")).to_parquet(data)
    mopd = SCRIPT + [f"{D}.teacher_key=data_source", f"data.train_files={data}",
                     f"+{D}.teacher_models.gsm8k.key=openai/gsm8k", f"+{D}.teacher_models.gsm8k.model_path={model_dir}",
                     f"+{D}.teacher_models.gsm8k.num_replicas=1",
                     f"+{D}.teacher_models.math.key=lighteval/MATH", f"+{D}.teacher_models.math.model_path={teacher_dir}"]
    trainer, _ = build_trainer(make_plan(load_config(tiny + mopd)))
    (stage,) = trainer.experience.stages
    teacher = stage.module
    assert isinstance(teacher, Teacher) and teacher.route_key == "data_source"
    assert set(teacher.teachers) == {"openai/gsm8k", "lighteval/MATH"}
    assert type(trainer.loss) is PolicyGradientDistillationLoss
    # a data_source no teacher has fails before training, naming it
    other = [a.replace("key=lighteval/MATH", "key=other/source") for a in mopd]
    with pytest.raises(ConfigError, match="no teacher has key='lighteval/MATH'"):
        build_trainer(make_plan(load_config(tiny + other)))


def test_forward_kl_topk_trains_with_the_teachers_top_k(tiny, teacher_dir, tmp_path, capsys):
    """verl's Megatron distillation script's loss (run_qwen3_8b_megatron.sh: forward_kl_topk, supervised, topk and
    log_prob_min_clamp as it sets them): the teacher writes its top-k, the loss reads the student's log-probs of them."""
    topk = single(teacher_dir) + [f"{L}.loss_mode=forward_kl_topk", f"{L}.use_policy_gradient=False", f"{L}.topk=8"]
    assert main(tiny + topk + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"Teacher.from_pretrained(paths={str(teacher_dir)!r}, top_k=8" in out
    assert "loss=DistillationLoss(kind='forward_kl_topk', max_clamp=10.0, log_prob_min_clamp=-10.0)" in out
    assert "topk" not in "".join(line for line in out.splitlines() if "has no effect" in line)
    assert main(tiny + topk + ["trainer.logger=[console,file]"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distillation/loss" in r]
    assert len(steps) == 2 and all(0 < r["distillation/teacher_mass"] <= 1 + 1e-5 for r in steps)
    assert all(r["distillation/loss"] > 0 and 0 < r["distillation/student_mass"] < 1 for r in steps)
    # as a reward verl warns that the top-k signal is mostly unused: so does rlflow
    assert main(tiny + topk + [f"{L}.use_policy_gradient=True", "--dry-run"]) == 0
    assert "top-k distributional signal is largely unused" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, error, message", [
    ([f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=0"], ConfigError, "topk=0: loss_mode=forward_kl_topk needs"),
    ([f"{L}.loss_mode=forward_kl_topk", f"{L}.topk=null"], ConfigError, "a positive integer"),
    ([f"{L}.loss_mode=forward_kl_topk", f"{L}.log_prob_min_clamp=low"], ConfigError, "log_prob_min_clamp='low'"),
    ([f"{L}.use_policy_gradient=False"], ConfigError, "backpropagating k1 is incorrect"),
    ([f"{L}.policy_loss_mode=gspo"], ConfigError, "only 'vanilla'"),
    ([f"{D}.teacher_key=ability", f"+{D}.teacher_models.a.key=x", f"+{D}.teacher_models.a.model_path=m",
      f"+{D}.teacher_models.b.key=y", f"+{D}.teacher_models.b.model_path=m"], NotSupportedError, "data_source"),
    ([f"+{D}.teacher_models.a.model_path=m", f"+{D}.teacher_models.b.key=y", f"+{D}.teacher_models.b.model_path=m"],
     ConfigError, "teacher_models.a.key: with several teachers"),
    ([f"{L}.loss_mode=full"], ConfigError, "choose one of"),
])
def test_what_rlflow_cannot_do_is_refused_naming_the_key(tiny, teacher_dir, overrides, error, message):
    with pytest.raises(error, match=message):
        make_plan(load_config(tiny + single(teacher_dir) + overrides))


def test_the_validation_knows_the_estimators_without_importing_torch():
    from rlflow.algorithms import distillation
    from rlflow.config.verl import distillation as keys

    assert keys.KINDS == distillation.KINDS


def test_enabled_without_a_teacher_model_names_the_key(tiny):
    with pytest.raises(ConfigError, match="teacher_models.teacher_model.model_path: the teacher's model is not set"):
        make_plan(load_config(tiny + SCRIPT))


def test_a_vision_language_student_distils_from_a_teacher_that_sees_the_images(vlm_files, tmp_path, monkeypatch):
    """verl's VL scripts (run_qwen3_vl_8b_fsdp.sh): the teacher scores each sample with its images."""
    import rlflow.config.verl.devices as devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 0)
    model = vlm_files / "model"
    argv = vision_overrides(vlm_files, tmp_path) + [
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=hf", "trainer.logger=[console,file]",
        *SCRIPT, f"{D}.teacher_models.teacher_model.model_path={model}"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if "distillation/teacher_kl" in r]
    assert abs(step["distillation/teacher_kl"]) < 1e-3  # the same model: its log-probs equal the sampler's
