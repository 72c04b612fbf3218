"""GRPO, assembled by hand from rlflow's modules.

    python recipes/grpo.py                       # built-in addition task, CPU, about a minute
    python recipes/grpo.py --model ./Qwen2.5-0.5B-Instruct --train train.parquet --val test.parquet

With a model folder and parquet files in verl's layout, rewards are dispatched
by ``data_source`` (GSM8K ``####``, MATH ``\\boxed{}``, DAPO ``Answer:``).
"""

import argparse

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.rewards import default_compute_score
from rlflow.tasks.addition import AdditionTask, exact_match, warm_started_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face model folder (default: the built-in task's tiny model)")
    p.add_argument("--train", help="training parquet (verl layout)")
    p.add_argument("--val", help="validation parquet")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL loss coefficient (low_var_kl); 0 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/grpo")
    args = p.parse_args()

    if args.model:  # real use: a local model folder and verl-style parquet files
        policy = Policy.from_pretrained(args.model)
        data = PromptData(args.train, val=args.val, seed=args.seed)
        reward = FunctionReward(default_compute_score)
        lr, max_new_tokens = args.lr or 1e-6, args.max_new_tokens or 512
    else:  # the built-in task
        task = AdditionTask()
        model, tokenizer = warm_started_model(task, args.seed)
        policy = Policy(model, tokenizer)
        data = task.data(args.seed)
        reward = FunctionReward(exact_match)
        lr, max_new_tokens = args.lr or 2e-4, args.max_new_tokens or task.max_new_tokens

    trainer = Trainer(
        policy=policy,
        rollout=HFRollout(n=args.n, temperature=1.0, max_new_tokens=max_new_tokens),
        reward=reward,
        estimator=GRPO(norm_by_std=True),
        loss=PPOLoss(clip_ratio=0.2, kl_coef=args.kl_coef, kl_type="low_var_kl"),
        optim=Optim(lr=lr, weight_decay=0.0),
        batching=Batching(batch_size=args.batch_size),
        loop=Loop(max_steps=args.steps, val_every=max(1, args.steps // 5), seed=args.seed),
        run=RunDir(path=args.run_dir, save_every=args.steps),
    )
    print(trainer.validate(data))
    trainer.fit(data)
    print(trainer.validate(data))


if __name__ == "__main__":
    main()
