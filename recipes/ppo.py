"""PPO with a critic (GAE), assembled by hand from rlflow's modules.

    python recipes/ppo.py                       # built-in addition task, CPU
    python recipes/ppo.py --model ./Qwen2.5-0.5B-Instruct --critic ./Qwen2.5-0.5B-Instruct \\
        --train train.parquet --val test.parquet
"""

import argparse
import copy

from rlflow import GAE, Critic, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, ValueLoss
from rlflow.rewards import default_compute_score
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model
from rlflow import Batching, Loop, Optim, RunDir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face model folder for the actor")
    p.add_argument("--critic", help="local model folder for the critic (default: a copy of the actor)")
    p.add_argument("--train", help="training parquet (verl layout)")
    p.add_argument("--val", help="validation parquet")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per step")
    p.add_argument("--mini-batch-size", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/ppo")
    args = p.parse_args()

    if args.model:
        policy = Policy.from_pretrained(args.model)
        critic = Critic.from_pretrained(args.critic or args.model)
        data = PromptData(args.train, val=args.val, seed=args.seed)
        reward, lr, critic_lr, max_new_tokens = FunctionReward(default_compute_score), 1e-6, 1e-5, 512
    else:
        task = AdditionTask()
        model, tokenizer = warm_started_model(task, args.seed)
        policy, critic = Policy(model, tokenizer), Critic(copy.deepcopy(model))
        data = task.data(args.seed)
        reward, lr, critic_lr, max_new_tokens = FunctionReward(exact_match), 1e-4, 1e-3, task.max_new_tokens

    trainer = Trainer(
        policy=policy,
        rollout=HFRollout(n=args.n, temperature=1.0, max_new_tokens=max_new_tokens),
        reward=reward,
        estimator=GAE(gamma=args.gamma, lam=args.lam),
        loss=PPOLoss(clip_ratio=0.2, kl_coef=args.kl_coef),
        critic=critic,
        value_loss=ValueLoss(clip_range=0.5),
        optim=Optim(lr=lr, critic_lr=critic_lr, weight_decay=0.0),
        batching=Batching(batch_size=args.batch_size, mini_batch_size=args.mini_batch_size),
        loop=Loop(max_steps=args.steps, val_every=max(1, args.steps // 5), seed=args.seed),
        run=RunDir(path=args.run_dir, save_every=args.steps),
    )
    print(trainer.validate(data))
    trainer.fit(data)
    print(trainer.validate(data))


if __name__ == "__main__":
    main()
