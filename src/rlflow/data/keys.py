"""Every key a batch can carry, in one place.

A batch is one ``tensordict.TensorDict`` of batch size ``[B]`` where
``B = prompts x n``. Letters in shapes: ``B`` batch, ``P`` prompt length,
``R`` response length. Per-token tensors cover response tokens only.
"""

# written by the data pipeline
PROMPT_IDS = "prompt_ids"  # B x P, int64, left-padded
PROMPT_MASK = "prompt_mask"  # B x P, int64, 1 on real tokens
DATA_SOURCE = "data_source"  # non-tensor, B strings
GROUND_TRUTH = "ground_truth"  # non-tensor, B
EXTRA_INFO = "extra_info"  # non-tensor, B dicts
PROMPT_TEXT = "prompt_text"  # non-tensor, B strings
ROW_INDEX = "row_index"  # B, int64: the prompt's position in the training rows (with a user's sampler)
RAW_PROMPT = "raw_prompt"  # non-tensor, B: the prompt as the data gave it (chat messages or a string)
AGENT_NAME = "agent_name"  # non-tensor, B: the agent loop the row names (verl's column; None: the default loop);
# only in batches with such rows
# vision-language prompts (rlflow.data.multimodal; verl's names)
MULTI_MODAL_INPUTS = "multi_modal_inputs"  # non-tensor, B dicts of the processor's tensors ({} without images)
MULTI_MODAL_DATA = "multi_modal_data"  # non-tensor, B dicts {"image": [PIL images]}: for engines with a processor

# written by the rollout
RESPONSE_IDS = "response_ids"  # B x R, int64, right-padded
RESPONSE_MASK = "response_mask"  # B x R, 0 on padding and on tool/observation tokens
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # B x R, float, the sampler's log-probs
GROUP = "group"  # B, int64: samples of one prompt share it
RESPONSE_TEXT = "response_text"  # non-tensor, B strings
REWARD_BASELINE = "reward_baseline"  # B, float: e.g. ReMax's greedy-rollout score
POLICY_VERSION = "policy_version"  # B, int64: the weight version that sampled the row (asynchronous rollouts; the oldest
# of its tokens' versions when a partial rollout spans several)
POLICY_VERSION_MAX = "policy_version_max"  # B, int64: the newest version among the row's tokens (partial rollouts)
TOKEN_POLICY_VERSION = "token_policy_version"  # B x R, int64: the version that sampled each token (-1: padding, tools)
# MoE routing replay from the rollout (verl's R3): the experts each token was routed to while it was generated, per MoE
# layer (L of them, in model order), k per token; -1 where the engine routed nothing (padding, the last token)
PROMPT_ROUTED_EXPERTS = "prompt_routed_experts"  # B x P x L x k, int16, aligned with prompt_ids
ROUTED_EXPERTS = "routed_experts"  # B x R x L x k, int16, aligned with response_ids

# written by an agent (multi-turn) rollout (rlflow.rollout.agent)
NUM_TURNS = "num_turns"  # B, int64: assistant turns + tool/user turns + 1, as verl counts them
STEP_REWARDS = "step_rewards"  # B, float: the sum of the trajectory's tool rewards and interaction turn scores

# written by the reward
SCORES = "scores"  # B, float: one score per sample
TOKEN_REWARDS = "token_rewards"  # B x R, float: the score on the last valid token
REWARD_COLUMN = "reward_column/"  # + a key: B, float: a scorer's extra (e.g. format_reward), for Reward(columns=)
RM_SCORES = "rm_scores"  # B, float: a reward model's scores, for a reward function that takes rm_score

# written by the policy, the reference and the critic
LOG_PROBS = "log_probs"  # B x R, the current policy (with grad during updates)
ENTROPY = "entropy"  # B x R
OLD_LOG_PROBS = "old_log_probs"  # B x R, the policy before this step's updates
REF_LOG_PROBS = "ref_log_probs"  # B x R, the frozen reference
TEACHER_LOG_PROBS = "teacher_log_probs"  # B x R, a distillation teacher's (rlflow.models.teacher)
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"  # B x R x k, the teacher's k most likely tokens' log-probs
TEACHER_TOPK_IDS = "teacher_topk_ids"  # B x R x k, those tokens' ids
TOPK_LOG_PROBS = "topk_log_probs"  # B x R x k, the policy's log-probs of the teacher's top-k (under autograd)
VALUES = "values"  # B x R, the critic
OLD_VALUES = "old_values"  # B x R, the critic before this step's updates

# written by the estimator
ADVANTAGES = "advantages"  # B x R
RETURNS = "returns"  # B x R

# written by an off-policy correction before the loss (rlflow.algorithms.correction)
IS_WEIGHTS = "is_weights"  # B x R, float: truncated pi_old / pi_rollout, detached, 0 on masked tokens

# self-play and token selection (rlflow.rollout.reference_responses, rlflow.algorithms.policy_losses)
IS_REFERENCE = "is_reference"  # B, bool: the row holds the prompt's reference (ground-truth) response, not a sample
COV_SELECTED = "cov_selected"  # B x R, bool: tokens chosen by Clip-Cov / KL-Cov's covariance rule
