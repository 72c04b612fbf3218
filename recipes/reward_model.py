"""A reward model steers the policy: train an RM on a simple preference, then GRPO with the RM as the reward.

    python recipes/reward_model.py                # built-in addition task, CPU, a few minutes

1. The preference: responses made of **even digits** are better. A rule measures it:
   ``even_digits(response)`` = the fraction of the response's characters that are even digits.
2. A tiny reward model (Qwen2 with a scalar head, built in code) learns the preference from pairs of
   random responses to the task's prompts (the one with more even digits is chosen), with the
   Bradley-Terry loss; its accuracy on held-out pairs is printed.
3. GRPO trains the warm-started addition policy with ``ModelReward`` as the reward. The rule rides along
   in a ``CombinedReward`` with weight 0: it is logged (``reward/even_digits/mean``) but never rewarded,
   so a rising rule score shows the RM steering the policy, not the rule.

Prints the RM's pair accuracy, then the RM score and the rule score at the start and the end of RL.
"""

import argparse
import random

import torch

from rlflow import GRPO, HFRollout, Policy, PPOLoss, Trainer
from rlflow.models.tiny import tiny_qwen2_reward_model
from rlflow.rewards import CombinedReward, ModelReward
from rlflow.rewards.model import preference_loss
from rlflow.tasks.addition import AdditionTask, warm_started_model
from rlflow.trainer.options import with_groups

EVEN = set("02468")


def even_digits(response: str, ground_truth: str = "") -> float:
    """The fraction of the response's characters that are even digits (0.0 for an empty response)."""
    text = response.strip()
    return sum(c in EVEN for c in text) / len(text) if text else 0.0


def preference_pairs(prompts: list[str], count: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """``(prompt, chosen, rejected)``: two random 1-3 digit responses, the one with more even digits chosen."""
    pairs = []
    while len(pairs) < count:
        prompt = rng.choice(prompts)
        a, b = ("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3))) for _ in range(2))
        if even_digits(a) != even_digits(b):
            pairs.append((prompt, a, b) if even_digits(a) > even_digits(b) else (prompt, b, a))
    return pairs


def encode(tokenizer, pairs, which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response + EOS`` ids (what ``ModelReward`` reads from the policy's samples)."""
    seqs = [tokenizer(p[0])["input_ids"] + tokenizer(p[which])["input_ids"] + [tokenizer.eos_token_id] for p in pairs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


def train_reward_model(tokenizer, prompts: list[str], *, steps: int = 300, batch_size: int = 64, seed: int = 0):
    """A tiny RM fitted to the even-digit preference; returns ``(ModelReward, held-out pair accuracy)``."""
    rng = random.Random(seed)
    model = tiny_qwen2_reward_model(len(tokenizer), hidden_size=64, num_layers=2, seed=seed)
    reward = ModelReward(model, micro_batch_size=256, name="reward_model")
    head = reward.module
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(steps):
        batch = preference_pairs(prompts, batch_size, rng)
        chosen, rejected = (head(*encode(tokenizer, batch, which)) for which in (1, 2))
        loss = preference_loss(chosen, rejected)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    head.eval().requires_grad_(False)
    held_out = preference_pairs(prompts, 512, random.Random(seed + 1))
    with torch.no_grad():
        accuracy = (head(*encode(tokenizer, held_out, 1)) > head(*encode(tokenizer, held_out, 2))).float().mean()
    return reward, accuracy.item()


def build(steps: int = 40, seed: int = 0, rm_steps: int = 300, run_dir: str = "runs/reward_model", **trainer_kwargs):
    """The RM (trained here) and a Trainer whose reward is the RM, the rule logged beside it with weight 0."""
    task = AdditionTask()
    model, tokenizer = warm_started_model(task, seed)
    data = task.data(seed)
    rm, accuracy = train_reward_model(tokenizer, [row["prompt"] for row in data.train], steps=rm_steps, seed=seed)
    reward = CombinedReward({"reward_model": rm, "even_digits": even_digits},
                            weights={"reward_model": 1.0, "even_digits": 0.0})
    trainer = Trainer(
        policy=Policy(model, tokenizer), rollout=HFRollout(n=8, max_new_tokens=task.max_new_tokens), reward=reward,
        estimator=GRPO(), loss=PPOLoss(clip_ratio=0.2),
        **with_groups(batch_size=32, lr=2e-4, weight_decay=0.0, max_steps=steps, run_dir=run_dir, seed=seed,
                      **({"loggers": ("jsonl",)} | trainer_kwargs)),
    )
    return trainer, data, accuracy


def summary(history: list[dict], window: int = 5) -> dict[str, tuple[float, float]]:
    """Mean RM score and rule score over the first and the last ``window`` steps."""
    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    first, last = history[:window], history[-window:]
    return {key: (mean(first, key), mean(last, key)) for key in ("reward/reward_model/mean", "reward/even_digits/mean")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps")
    p.add_argument("--rm-steps", type=int, default=300, help="reward-model training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/reward_model")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    trainer, data, accuracy = build(args.steps, args.seed, args.rm_steps, args.run_dir)
    print(f"reward model: held-out preference accuracy {accuracy:.3f}")
    history = trainer.fit(data)
    for key, (start, end) in summary(history).items():
        print(f"{key}: {start:.3f} -> {end:.3f} (mean of the first / last 5 steps)")


if __name__ == "__main__":
    main()
