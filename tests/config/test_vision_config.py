"""The verl entry point with a vision-language model: the seed's VLM snippet on a local tiny Qwen2.5-VL
folder, verl's multimodal parquet layout (data.image_key) and the processor's pixel bounds."""

import random

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_trainer, run_notes
from rlflow.models.tiny_vlm import save_model_folder, tiny_processor, tiny_qwen2_5_vl
from rlflow.tasks import shapes
from rlflow.trainer.main_ppo import main

# The seed's "視覚言語モデル" snippet, with a local folder in place of Qwen/Qwen2.5-VL-7B-Instruct.
SEED_SNIPPET = """\
actor_rollout_ref:
  model:
    path: {model}
  rollout:
    name: vllm
    enable_vision: true
"""


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory):
    """A tiny Qwen2.5-VL folder and shapes-task parquet files whose image column is named ``picture``."""
    root = tmp_path_factory.mktemp("vlm")
    processor = tiny_processor()
    save_model_folder(tiny_qwen2_5_vl(processor.tokenizer, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0),
                      processor, root / "model")
    rng = random.Random(0)
    for split, n in (("train", 8), ("test", 4)):
        rows = [shapes.row(rng) for _ in range(n)]
        pd.DataFrame([{**r, "picture": r.pop("images")} for r in rows]).to_parquet(root / f"{split}.parquet")
    return root


def overrides(root, tmp_path):
    return [f"data.train_files={root}/train.parquet", f"data.val_files={root}/test.parquet",
            "data.image_key=picture", "data.max_pixels=3136", "data.min_pixels=3136", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=64", "data.max_response_length=3",
            "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}/run", "trainer.logger=[console]",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.use_remove_padding=true"]


def test_the_seeds_vlm_snippet_runs_on_a_local_tiny_model(vlm_files, tmp_path, monkeypatch, capsys):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "vlm.yaml").write_text(SEED_SNIPPET.format(model=vlm_files / "model"))
    monkeypatch.chdir(tmp_path)
    argv = ["--config-path", "config", "--config-name", "vlm"] + overrides(vlm_files, tmp_path)
    assert main(argv) == 2  # rollout.name: vllm, as in the seed: rlflow's vLLM rollout takes no images yet
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.name" in err and "VLLMRollout takes no images" in err and "name=hf" in err
    assert main(argv + ["actor_rollout_ref.rollout.name=hf", "--dry-run"]) == 0
    report = capsys.readouterr().out
    assert "image_key='picture'" in report and "max_pixels=3136" in report and "prompt tokens: max 53" in report
    assert "processor=load_processor(path=" in report and "Not said by the tree yet" not in report  # a node
    assert main(argv + ["actor_rollout_ref.rollout.name=hf"]) == 0
    out = capsys.readouterr().out
    assert "val-core/rlflow/shapes/reward/mean@1" in out and "step:1 " in out


def test_vision_keys_reach_the_policy_and_the_data(vlm_files, tmp_path):
    cfg = load_config(overrides(vlm_files, tmp_path) + [f"actor_rollout_ref.model.path={vlm_files}/model",
                                                        "actor_rollout_ref.rollout.enable_vision=true"])
    trainer, data = build_trainer(make_plan(cfg))
    processor = trainer.policy.processor
    assert processor.image_processor.size == {"shortest_edge": 3136, "longest_edge": 3136}  # 56 x 56 pixels
    batch = data.collate(data.train[:2], processor.tokenizer)
    assert [r["image_grid_thw"].tolist() for r in batch["multi_modal_inputs"]] == [[[1, 4, 4]]] * 2
    assert trainer.reference is None or trainer.reference.processor is processor


def test_enable_vision_needs_an_image_text_to_text_model(tmp_path, vlm_files):
    from rlflow.config.verl.loading import ConfigError
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    cfg = load_config(overrides(vlm_files, tmp_path) + [f"actor_rollout_ref.model.path={tmp_path}/lm",
                                                        "actor_rollout_ref.rollout.enable_vision=true"])
    with pytest.raises(ConfigError, match="enable_vision=True but .* is not an image-text-to-text model"):
        build_trainer(make_plan(cfg))


def test_remax_regenerates_greedily_with_the_pictures(vlm_files, tmp_path, monkeypatch):
    """ReMax's greedy baseline re-generates each prompt: its images must go with it."""
    cfg = load_config(overrides(vlm_files, tmp_path) + [f"actor_rollout_ref.model.path={vlm_files}/model",
                                                        "algorithm.adv_estimator=remax"])
    trainer, data = build_trainer(make_plan(cfg))
    batch = data.collate(data.train[:2], trainer.policy.tokenizer)
    sampled = trainer.rollout(batch)
    engine, seen = trainer.rollout.engine, []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda p, params, mm=None: seen.append(mm) or generate(p, params, mm))
    out = trainer.experience.stages[0](sampled)  # the GreedyBaseline stage
    assert [[m.inputs["image_grid_thw"].tolist() for m in mm] for mm in seen] == [[[[1, 4, 4]]] * 2]
    greedy = trainer.rollout.with_options(n=1, do_sample=False)(batch)  # the same prompts with their pictures
    assert out["reward_baseline"].tolist() == trainer.reward(greedy)["scores"].repeat_interleave(2).tolist()


def test_bad_images_stop_the_run_naming_the_row_or_are_skipped_and_counted(vlm_files, tmp_path):
    from rlflow.config.verl.loading import ConfigError

    frame = pd.read_parquet(vlm_files / "train.parquet")
    frame.at[3, "picture"] = [{"bytes": b"not a png", "path": None}]
    frame.to_parquet(tmp_path / "bad.parquet")
    keys = overrides(vlm_files, tmp_path) + [f"actor_rollout_ref.model.path={vlm_files}/model",
                                             f"data.train_files={tmp_path}/bad.parquet"]
    with pytest.raises(ConfigError, match=r"bad.parquet, row 3, image 0"):
        build_trainer(make_plan(load_config(keys)))
    plan = make_plan(load_config(keys + ["data.bad_images=skip"]))
    trainer, data = build_trainer(plan)
    assert len(data.train) == 7 and data.skipped_images == {"train": 1, "val": 0}
    assert any("data.bad_images=skip: dropped 1 training and 0 validation row(s)" in n
               for n in run_notes(plan, data, trainer))
    with pytest.raises(ConfigError, match="data.bad_images='drop': choose 'error'"):
        make_plan(load_config(keys + ["data.bad_images=drop"]))


def test_image_patch_size_and_the_geometry3k_reward_through_the_entry_point(vlm_files, tmp_path, capsys):
    """verl's geo3k layout (data_source hiyouga/geometry3k, an image per row as bytes): data.image_patch_size
    resizes the images before the processor (100 x 100 pixels: 112 x 112 with verl's default 14, 96 -> 84 with
    16), and the geometry3k reward is built in (the entry point accepts the data)."""
    from tests.vlm import png

    rows = [{"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": "<image>find x"}],
             "images": [{"bytes": png(100, 100)}], "reward_model": {"style": "rule", "ground_truth": str(i)}}
            for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "geo.parquet")
    keys = [o for o in overrides(vlm_files, tmp_path) if not o.startswith("data.")]  # the processor's own pixel bounds
    keys += [f"data.train_files={tmp_path}/geo.parquet", "data.max_prompt_length=64", "data.max_response_length=3",
             "data.train_batch_size=4",
             f"actor_rollout_ref.model.path={vlm_files}/model", "actor_rollout_ref.rollout.enable_vision=true"]

    def grids(*extra):
        trainer, data = build_trainer(make_plan(load_config(keys + list(extra))))
        batch = data.collate(data.train[:1], trainer.policy.processor.tokenizer)
        return batch["multi_modal_inputs"][0]["image_grid_thw"].tolist()

    assert grids() == grids("data.image_patch_size=null") == [[1, 8, 8]]  # verl's 14 = this processor's own
    assert grids("data.image_patch_size=16") == [[1, 6, 6]]
    assert main(keys + ["data.image_patch_size=0", "--dry-run"]) == 2
    assert "data.image_patch_size=0: must be a positive number" in capsys.readouterr().err
