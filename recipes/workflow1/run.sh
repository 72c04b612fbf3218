#!/usr/bin/env bash
# The seed's Workflow 1 (GRPO for math reasoning) on SmolLM2-135M-Instruct, on CPU (docs/workflow1.md):
# step 1 the data, step 2 the reward file, step 3 the seed's config/grpo_math.yaml (examples/config), step 4 the
# seed's command with CPU-size overrides. From the repository root:
#
#   recipes/workflow1/run.sh                  # generation with vLLM's CPU build (the YAML's rollout.name: vllm)
#   ROLLOUT=hf recipes/workflow1/run.sh       # generation with transformers (machines without vLLM)
#   SEED=2 recipes/workflow1/run.sh trainer.total_training_steps=20    # more key=value overrides go last
set -euo pipefail
cd "$(dirname "$0")/../.."
SEED=${SEED:-1}
ROLLOUT=${ROLLOUT:-vllm}
RUN_DIR=${RUN_DIR:-runs/workflow1/$ROLLOUT-seed$SEED}
if [ "$ROLLOUT" = vllm ]; then
    engine=(actor_rollout_ref.rollout.dtype=float32 actor_rollout_ref.rollout.enforce_eager=true)
else
    engine=(actor_rollout_ref.rollout.name=hf)
fi

python recipes/workflow1/prepare_data.py --out runs/workflow1/data
python3 -m rlflow.trainer.main_ppo --config-path examples/config --config-name grpo_math \
    trainer.experiment_name=workflow1_smollm2 \
    data.train_files=runs/workflow1/data/train.parquet data.val_files=runs/workflow1/data/val.parquet \
    actor_rollout_ref.model.path="$(rlflow get-model smollm2)" \
    custom_reward_function.path=recipes/workflow1/reward_function.py custom_reward_function.name=compute_reward \
    trainer.device=cpu trainer.n_gpus_per_node=1 \
    data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.n=4 \
    data.max_prompt_length=128 data.max_response_length=32 \
    actor_rollout_ref.actor.optim.lr=1e-5 \
    actor_rollout_ref.model.enable_gradient_checkpointing=false actor_rollout_ref.model.use_remove_padding=false \
    trainer.total_training_steps=10 trainer.test_freq=5 trainer.save_freq=-1 \
    trainer.logger=[console,file] data.seed="$SEED" trainer.default_local_dir="$RUN_DIR" \
    "${engine[@]}" "$@"
