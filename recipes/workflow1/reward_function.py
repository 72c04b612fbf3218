"""Step 2 of the seed's Workflow 1, as the seed writes it: ``compute_reward(responses, ground_truths)``, a batch
reward (1.0 for the right answer in ``\\boxed{}``, else 0.0).

rlflow calls a function of this form once per batch with the decoded responses and the rows'
``reward_model.ground_truth``. Select it with
``custom_reward_function.path=recipes/workflow1/reward_function.py custom_reward_function.name=compute_reward``
(verl's default name is ``compute_score``).
"""

# reward_function.py
import re


def compute_reward(responses, ground_truths):
    rewards = []
    for response, gt in zip(responses, ground_truths):
        # Extract answer from response
        match = re.search(r'\\boxed{([^}]+)}', response)
        if match and match.group(1).strip() == gt.strip():
            rewards.append(1.0)
        else:
            rewards.append(0.0)
    return rewards
