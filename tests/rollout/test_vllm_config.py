"""The seed's commands with ``rollout.name=vllm``: its quick start and config/grpo_math.yaml, as written, on a
tiny local model (sizes and the CPU test engine's dtype/eager/length set on the command line)."""

from pathlib import Path

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
import rlflow.rollout.engines.vllm
from rlflow.config import load_config, make_plan
from rlflow.config.verl.run import unused_notes
from rlflow.trainer.main_ppo import main
from tests.config.conftest import verl_rows
from tests.config.test_main_ppo import EXAMPLE, QUICK_START, steps
from tests.rollout.conftest import MAX_MODEL_LEN, requires_vllm

R = "actor_rollout_ref.rollout"
# The session engine's options (tests/rollout/conftest.py ENGINE_OPTIONS) in verl's keys: these runs reuse it.
CPU_ENGINE = [f"{R}.dtype=float32", f"{R}.enforce_eager=true", f"{R}.max_model_len={MAX_MODEL_LEN}"]


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


@pytest.fixture
def gsm8k(tmp_path):
    pd.DataFrame(verl_rows(12, "train", 0)).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(verl_rows(4, "test", 1)).to_parquet(tmp_path / "test.parquet")
    return tmp_path


def sizes(tmp_path):
    return ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"{R}.n=2", "data.max_prompt_length=8",
            "data.max_response_length=4", "trainer.total_training_steps=2", "trainer.logger=[console]",
            f"trainer.default_local_dir={tmp_path}/run"]


@requires_vllm
def test_seed_yaml_runs_with_vllm_as_written(vllm_engine, vllm_model_dir, gsm8k, tmp_path, monkeypatch, capsys):
    config = tmp_path / "config"
    config.mkdir()
    text = (EXAMPLE.read_text().replace("~/data/gsm8k/train.parquet", f"{gsm8k}/train.parquet")
            .replace("~/data/gsm8k/test.parquet", f"{gsm8k}/test.parquet")
            .replace("~/models/Qwen2.5-7B-Instruct", str(vllm_model_dir)))
    assert "name: vllm" in text and "temperature: 0.7" in text and "top_p: 0.95" in text
    (config / "grpo_math.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    argv = ["--config-path", "config", "--config-name", "grpo_math"] + sizes(tmp_path) + CPU_ENGINE
    assert main(argv) == 0
    out = capsys.readouterr().out
    logged = steps(out)
    assert sorted(logged) == [0, 1, 2]  # validation before training, then 2 RL steps
    assert rlflow.rollout.engines.vllm._POOL and len(rlflow.rollout.engines.vllm._POOL) == 1  # the session engine
    assert logged[2]["weight_sync/gb"] > 0 and logged[2]["timing_s/update_weights"] > 0
    ignored = [line for line in out.splitlines() if "note:" in line and R in line
               and ("has no effect" in line or "is not used" in line)]
    assert ignored == []  # every rollout key of the YAML and the command line was used


@requires_vllm
def test_quick_start_with_rollout_name_vllm(vllm_engine, vllm_model_dir, gsm8k, tmp_path, capsys):
    argv = [a for a in QUICK_START if not a.startswith(("actor_rollout_ref.model.path", "data.train_files",
                                                          "trainer.n_gpus_per_node", f"{R}.n="))]
    argv += [f"{R}.name=vllm", f"actor_rollout_ref.model.path={vllm_model_dir}",
             f"data.train_files={gsm8k}/train.parquet", f"data.val_files={gsm8k}/test.parquet"]
    assert main(argv + sizes(tmp_path) + CPU_ENGINE) == 0
    logged = steps(capsys.readouterr().out)
    assert logged[2]["actor/kl_coef"] == 0.001 and "weight_sync/gb" in logged[2]


@requires_vllm  # the plan checks that the engine can run here
def test_engine_keys_are_honoured_or_noted():
    """Every rollout key of verl's vLLM rollout reaches the engine or gets a note saying why it cannot."""
    plan = make_plan(load_config([
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", f"{R}.name=vllm", f"{R}.tensor_model_parallel_size=2",
        f"{R}.gpu_memory_utilization=0.9", f"{R}.load_format=dummy", f"{R}.max_num_seqs=16",
        f"{R}.max_num_batched_tokens=2048", f"{R}.enable_chunked_prefill=false", f"{R}.enforce_eager=true",
        f"{R}.dtype=float32", f"{R}.free_cache_engine=true", f"{R}.update_weights_bucket_megabytes=64",
        f"+{R}.engine_kwargs.vllm.kv_cache_memory_bytes=1000000", f"{R}.cudagraph_capture_sizes=[1,2]",
        f"{R}.val_kwargs.temperature=0.6", f"{R}.val_kwargs.do_sample=true", f"{R}.layered_summon=true",
        "data.max_prompt_length=100", "data.max_response_length=28"]))
    kw = plan.rollout_kwargs
    assert plan.rollout_cls.__name__ == "VLLMRollout"
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["enable_chunked_prefill"]) == (16, 2048, False)
    assert (kw["enforce_eager"], kw["dtype"], kw["max_model_len"], kw["bucket_bytes"]) == (True, "float32", 128, 64 * 2**20)
    assert kw["engine_kwargs"] == {"kv_cache_memory_bytes": 1000000, "compilation_config": {"cudagraph_capture_sizes": [1, 2]}}
    assert kw["gpu_memory_utilization"] is None  # a GPU fraction; on CPU the KV cache is sized in bytes
    assert plan.val_sampling["temperature"] == 0.6
    notes = "\n".join([*plan.notes, *unused_notes(plan.cfg)])
    for key in ("tensor_model_parallel_size=2: rlflow runs one in-process vLLM engine per training process",
                "gpu_memory_utilization=0.9: a fraction of GPU memory", "load_format='dummy': the engine starts",
                "free_cache_engine=True: sleeping", "layered_summon=True"):
        assert key in notes, key
    assert "is not used" not in notes and "has no effect" not in notes
    hf = make_plan(load_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"{R}.max_num_seqs=16"]))
    assert "max_num_seqs=16 has no effect in rlflow: a vLLM/SGLang engine setting" in "\n".join(unused_notes(hf.cfg))


@requires_vllm
def test_enable_prefix_caching_reaches_the_engine_and_the_server_command(vllm_engine):
    """verl's rollout.enable_prefix_caching (default true) -> VLLMRollout -> vllm.LLM; the session engine shows the
    default arriving in vLLM's cache config; the server command line carries either value; HF: a note."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rlflow.rollout import VLLMRollout
    from rlflow.rollout.server import vllm_server_command

    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"{R}.name=vllm"]
    on, off = (make_plan(load_config(base + extra)) for extra in ([], [f"{R}.enable_prefix_caching=false"]))
    assert on.rollout_kwargs["enable_prefix_caching"] is True and off.rollout_kwargs["enable_prefix_caching"] is False
    assert VLLMRollout(**off.rollout_kwargs).engine.settings["enable_prefix_caching"] is False
    engine = vllm_engine[0]  # started with VLLMRollout's default, which is verl's
    assert engine.options["enable_prefix_caching"] is True
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    parser = make_arg_parser(FlexibleArgumentParser())
    for flag in (True, False):
        cmd = vllm_server_command("/tmp/model", 8000, enable_prefix_caching=flag)
        assert cmd[:3] == [cmd[0], "-m", "vllm.entrypoints.openai.api_server"]
        assert parser.parse_args(cmd[3:]).enable_prefix_caching is flag
    server = make_plan(load_config(base + [f"{R}.server.url=http://127.0.0.1:1", f"{R}.enable_prefix_caching=false"]))
    assert "enable_prefix_caching=False: a setting of the server" in "\n".join(server.notes)
    hf = make_plan(load_config(base[:2] + [f"{R}.enable_prefix_caching=false"]))
    assert "enable_prefix_caching=False has no effect in rlflow: vLLM's cache of prompt blocks" in \
        "\n".join(unused_notes(hf.cfg))


def test_the_seed_example_still_names_vllm():
    assert "name: vllm" in Path(EXAMPLE).read_text()


@requires_vllm
def test_grpo_vllm_recipe_trains(vllm_engine, tmp_path, monkeypatch):
    """recipes/yaml/grpo_vllm.yaml on a small prepared task (an untrained model of the default job's shape)."""
    from rlflow.config.verl.build import build_trainer
    from rlflow.config.verl.native import load_native
    from rlflow.tasks import prepare as export
    from rlflow.tasks.addition import AdditionTask

    monkeypatch.setattr(export, "warm_started_model", lambda task, seed, **_: (task.model(seed), task.tokenizer()))
    task = export.export_task(tmp_path / "task", task=AdditionTask(max_operand=5, held_out=8, warm_val=4))
    recipe = Path(__file__).parents[2] / "recipes" / "yaml" / "grpo_vllm.yaml"
    plan = make_plan(load_native(recipe, [
        f"policy.path={task}/model", f"data.train={task}/train.parquet", f"data.val={task}/test.parquet",
        "trainer.batch_size=4", "trainer.mini_batch_size=2", "rollout.n=2", "trainer.max_steps=1",
        "trainer.loggers=[console]", f"trainer.run_dir={tmp_path}/run"]))
    assert plan.rollout_cls.__name__ == "VLLMRollout" and plan.rollout_kwargs["enforce_eager"] is True
    trainer, data = build_trainer(plan)
    assert trainer.rollout.engine.llm is vllm_engine[0].llm  # same model shape and options: the session's engine
    history = trainer.fit(data)
    assert len(history) == 1 and history[0]["weight_sync/gb"] > 0
    assert any(k.startswith("val-core/rlflow/addition/") for k in history[-1])


def test_rollout_flag_reaches_the_default_job(monkeypatch):
    import rlflow.tasks.default_job as default_job
    from rlflow.cli import main as cli_main

    calls = []
    monkeypatch.setattr(default_job, "run", lambda **kwargs: calls.append(kwargs))
    assert cli_main(["train", "--rollout", "vllm", "--steps", "3"]) == 0
    assert calls[0]["rollout"] == "vllm" and calls[0]["steps"] == 3
    with pytest.raises(SystemExit):  # with a config the engine is a config key
        cli_main(["train", "--rollout", "vllm", "algorithm.adv_estimator=grpo"])
    assert set(default_job.ROLLOUTS) == {"hf", "vllm"}
