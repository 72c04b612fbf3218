"""verl 0.9's newer data / trainer keys through the verl entry point: each honoured key takes effect, the
refused ones name the key and the feature, the inert ones get a note."""

import json

import numpy as np
import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import ConfigError, load_config, make_plan
from rlflow.config.verl.build import build_trainer, run_notes
from rlflow.config.verl.run import unused_notes
from rlflow.trainer.main_ppo import main
from tests.config.conftest import CHAT_TEMPLATE, verl_rows
from tests.config.test_vision_config import overrides as vlm_overrides
from tests.config.test_vision_config import vlm_files  # noqa: F401 - a fixture

MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def indices(rows):
    return [r["extra_info"]["index"] for r in rows]


def test_max_samples_pick_the_rows_verl_picks(tiny):
    """verl's RLHFDataset: with data.shuffle, default_rng(data.seed).choice(total, N, replace=False); else the first N."""
    _, data = build_trainer(make_plan(load_config(tiny + ["data.train_max_samples=5", "data.val_max_samples=2"])))
    assert indices(data.train) == np.random.default_rng(1).choice(12, size=5, replace=False).tolist()  # data.seed=1
    assert indices(data.val) == np.random.default_rng(1).choice(4, size=2, replace=False).tolist()
    _, data = build_trainer(make_plan(load_config(tiny + ["data.train_max_samples=5", "data.shuffle=false",
                                                          "data.seed=7"])))
    assert indices(data.train) == [0, 1, 2, 3, 4] and len(data.val) == 4
    _, data = build_trainer(make_plan(load_config(tiny + ["data.train_max_samples=-1", "data.val_max_samples=40"])))
    assert len(data.train) == 12 and len(data.val) == 4
    with pytest.raises(ConfigError, match="data.train_max_samples='all': expected an integer"):
        load_config(tiny + ["data.train_max_samples=all"])


def test_tool_schemas_count_in_the_overlong_filter(tiny, tmp_path, data_dir):
    """data.tool_config_path (verl: multi_turn.tool_config_path) renders the tools into the measured prompt."""
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: rlflow.rollout.tools.Calculator\n")
    template = "{% for t in tools or [] %}{{ t['function']['name'] }}:{% endfor %}" + CHAT_TEMPLATE
    (tmp_path / "run.yaml").write_text(json.dumps({"actor_rollout_ref": {"model": {"custom_chat_template": template}}}))
    args = tiny + ["data.filter_overlong_prompts=true", "data.max_prompt_length=16", f"{MT}.enable=true",
                   f"{MT}.tool_config_path={tmp_path}/tools.yaml"]
    # "calculator:" (11 characters, one token each) + "a+b" + "=": two-digit + two-digit questions are 17 tokens
    long = sum(11 + len(r["prompt"][0]["content"]) + 1 > 16 for r in verl_rows(12, "train", 0))
    assert 0 < long < 12
    plan = make_plan(load_config(args, config_file=tmp_path / "run.yaml"))
    assert [s["function"]["name"] for s in plan.data_kwargs["tool_schemas"]] == ["calculator"]
    _, data = build_trainer(plan)
    assert data.filtered["train"] == long and len(data.train) == 12 - long
    _, data = build_trainer(make_plan(load_config(args + ["data.tool_config_path=null"], config_file=tmp_path / "run.yaml")))
    assert data.filtered["train"] == 0  # without the schemas every prompt fits


def test_mm_processor_kwargs_reach_the_processor_call(vlm_files, tmp_path):  # noqa: F811
    args = vlm_overrides(vlm_files, tmp_path) + [f"actor_rollout_ref.model.path={vlm_files}/model",
                                                 "actor_rollout_ref.rollout.enable_vision=true",
                                                 "data.max_prompt_length=256"]
    grids = []
    for extra in ([], ["+data.mm_processor_kwargs.size.shortest_edge=12544",
                            "+data.mm_processor_kwargs.size.longest_edge=12544"]):
        cfg = load_config(args + extra)
        trainer, data = build_trainer(make_plan(cfg))
        batch = data.collate(data.train[:1], trainer.policy.tokenizer)
        grids.append(batch["multi_modal_inputs"][0]["image_grid_thw"].tolist())
        assert not any(n.startswith("data.mm_processor_kwargs") for n in unused_notes(cfg))
    assert grids == [[[1, 4, 4]], [[1, 8, 8]]]  # 56 x 56 pixels (data.max_pixels), then 112 x 112


def test_mm_processor_kwargs_without_a_processor_get_a_note(tiny):
    plan = make_plan(load_config(tiny + ["+data.mm_processor_kwargs.max_pixels=100"]))
    trainer, data = build_trainer(plan)
    said = run_notes(plan, data, trainer)
    assert any("data.mm_processor_kwargs={'max_pixels': 100} has no effect" in n for n in said)
    assert said[:len(plan.notes)] == list(plan.notes)  # the plan's notes first: building adds its own apart


def test_v1_sync_is_rlflows_loop_and_its_async_modes_are_fully_async(tiny):
    assert make_plan(load_config(tiny + ["trainer.use_v1=true", "trainer.v1.trainer_mode=sync"])).fully_async is None
    assert make_plan(load_config(tiny + ["trainer.v1.trainer_mode=separate_async"])).fully_async is not None
    with pytest.raises(ConfigError, match="trainer.v1.trainer_mode='fast': choose from sync, colocate_async"):
        make_plan(load_config(tiny + ["trainer.v1.trainer_mode=fast"]))
    plan = make_plan(load_config(tiny + ["trainer.use_v1=false", "trainer.v1.trainer_mode=colocate_async"]))
    assert any("has no effect with trainer.use_v1=False" in n for n in plan.notes)


CALLBACK = '''
import json, os

class Record:
    def __init__(self, config=None):
        self.config = config

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        with open(os.path.join(self.config.trainer.default_local_dir, "..", "saves.jsonl"), "a") as f:
            f.write(json.dumps({"step": global_step, "dir": checkpoint_dir, "async": async_save,
                                "exists": os.path.isdir(checkpoint_dir)}) + "\\n")
'''


def test_checkpoint_callback_class_runs_after_each_save(tiny, tmp_path, monkeypatch):
    (tmp_path / "my_callbacks.py").write_text(CALLBACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(tiny + ["trainer.save_freq=1", "trainer.checkpoint_callback_class=my_callbacks.Record"]) == 0
    saves = [json.loads(line) for line in (tmp_path / "saves.jsonl").read_text().splitlines()]
    assert saves == [{"step": s, "dir": str(tmp_path / "run" / f"global_step_{s}"), "async": False, "exists": True}
                     for s in (1, 2)]
    for name, message in (("Record", "fully qualified name"), ("no_such_mod.Cb", "cannot import module 'no_such_mod'"),
                          ("my_callbacks.Nope", "module 'my_callbacks' has no 'Nope'"),
                          ("json.JSONDecoder", "has no on_save")):
        with pytest.raises(ConfigError, match=f"trainer.checkpoint_callback_class='{name}': .*{message}"):
            make_plan(load_config(tiny + [f"trainer.checkpoint_callback_class={name}"]))


@pytest.mark.parametrize("override, reason", [
    ("transfer_queue.enable=true", "verl's TransferQueue"),
    ("distillation.teacher_models.teacher_model.model_path=t", "only used with distillation.enabled=True"),
    ("trainer.v1.separate_async.parameter_sync_step=2", "pushes weights once per step"),
    ("trainer.v1.colocate_async.num_warmup_batches=2", "only used with that trainer.v1.trainer_mode"),
    ("algorithm.filter_groups.max_inflight_gen_batches=4", "one data.train_batch_size batch at a time"),
    ("reward_model.rollout.tensor_model_parallel_size=4", "verl's reward-model servers"),
    ("skip.rollout.steps=[1]", "only used with skip.*.enable=True"),
    ("data.audio_key=sound", "audio inputs are not supported yet"),
])
def test_inert_keys_say_why_they_change_nothing(tiny, override, reason):
    cfg = load_config(tiny + [override])
    make_plan(cfg)
    key = override.split("=")[0]
    assert any(n.startswith(f"{key}=") and "has no effect in rlflow" in n and reason in n for n in unused_notes(cfg))
