"""GRPO for a vision-language model, assembled by hand from rlflow's modules.

    python recipes/vision.py                     # built-in shapes task, tiny Qwen2.5-VL, CPU, a few minutes
    python recipes/vision.py --model ./Qwen2.5-VL-3B-Instruct --train geo3k/train.parquet \\
        --val geo3k/test.parquet --reward my_reward.py --max-pixels 401408

With a model folder, parquet files in verl's multimodal layout (``images`` column, ``<image>``
placeholders; see docs/vision.md) and a reward file defining ``compute_score(data_source,
solution_str, ground_truth, extra_info=None)``. The only differences from a text recipe: the Policy
holds the processor, and PromptData reads the images with it.
"""

import argparse

from rlflow import GRPO, FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.tasks.shapes import ShapesTask, exact_match, warm_started_policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local image-text-to-text model folder (default: the built-in task's tiny VLM)")
    p.add_argument("--train", help="training parquet (verl's multimodal layout)")
    p.add_argument("--val", help="validation parquet")
    p.add_argument("--reward", help="a Python file defining compute_score (with --model)")
    p.add_argument("--image-key", default="images", help="the column holding each row's images")
    p.add_argument("--min-pixels", type=int, default=None, help="processor: smallest image size (pixels)")
    p.add_argument("--max-pixels", type=int, default=None, help="processor: largest image size (pixels)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/vision-recipe")
    args = p.parse_args()

    if args.model:  # real use: a local VLM folder and verl-style parquet files
        import importlib.util

        spec = importlib.util.spec_from_file_location("reward", args.reward)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        policy = Policy.from_pretrained(args.model, min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                                        remove_padding=True)
        data = PromptData(args.train, val=args.val, processor=policy.processor, image_key=args.image_key,
                          seed=args.seed)
        reward = FunctionReward(module.compute_score)
        lr, max_new_tokens = args.lr or 1e-6, args.max_new_tokens or 1024
    else:  # the built-in task
        task = ShapesTask()
        policy, data = warm_started_policy(task, args.seed, remove_padding=True)
        reward = FunctionReward(exact_match)
        lr, max_new_tokens = args.lr or 2e-3, args.max_new_tokens or task.max_new_tokens

    trainer = Trainer(
        policy=policy,
        rollout=HFRollout(n=args.n, temperature=1.0, max_new_tokens=max_new_tokens),
        reward=reward,
        estimator=GRPO(),
        loss=PPOLoss(clip_ratio=0.2),
        optim=Optim(lr=lr, weight_decay=0.0),
        batching=Batching(batch_size=args.batch_size),
        loop=Loop(max_steps=args.steps, val_every=max(1, args.steps // 4), seed=args.seed),
        run=RunDir(path=args.run_dir),
    )
    print(trainer.validate(data))
    history = trainer.fit(data)
    print({k: v for k, v in history[-1].items() if k.startswith("val-core/")})


if __name__ == "__main__":
    main()
