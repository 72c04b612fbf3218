"""Run by torchrun from test_vision_fsdp2.py: one GRPO-style step of a tiny Qwen2.5-VL under a strategy.

    python -m torch.distributed.run --nproc_per_node N vision_worker.py OUT STRATEGY

Half of the prompts have no image and micro-batches hold one sample, so under FSDP2 one rank often
runs a micro-batch without any image while the other runs one with images (the vision blocks are
sharded units: both must take part in their collectives). Rows are re-dealt over the ranks by tokens
(balancing carries their vision inputs). Writes, on rank 0, OUT/result.pt with the step's metrics, the
full weights after it, and whether the vision blocks' parameters were sharded.
"""

import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rlflow import FunctionReward, HFRollout, Policy, PPOLoss, PromptData, Trainer
from rlflow.models.tiny_vlm import tiny_processor, tiny_qwen2_5_vl
from rlflow import Batching, Hardware, Loop, Optim, RunDir

try:
    from .worker import Record, ReturnAsAdvantage, varied
    from ..vlm import png
except ImportError:  # run as a script by torchrun
    sys.path[:0] = [str(__import__("pathlib").Path(__file__).parents[2])]
    from tests.distributed.worker import Record, ReturnAsAdvantage, varied
    from tests.vlm import png


def rows() -> list[dict]:
    sizes = [(56, 56), (84, 56), (112, 84), (56, 112)]
    out = []
    for i in range(8):
        if i % 2:
            out.append({"prompt": f"{i}+{i}=?", "ground_truth": str(2 * i)})
        else:
            w, h = sizes[i // 2]
            out.append({"prompt": "<image>how many red squares?", "images": [{"bytes": png(w, h, (40 * i, 0, 0))}],
                        "ground_truth": str(i)})
    return out


def build(out, strategy, devices):
    torch.manual_seed(0)
    processor = tiny_processor(min_pixels=56 * 56, max_pixels=112 * 112)
    model = tiny_qwen2_5_vl(processor.tokenizer, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                            vision_hidden_size=32, seed=0)
    record = Record()
    trainer = Trainer(
        policy=Policy(model, processor=processor, remove_padding=True),
        rollout=HFRollout(n=1, do_sample=False, max_new_tokens=4),
        reward=FunctionReward(varied), loss=PPOLoss(), estimator=ReturnAsAdvantage(),
        callbacks=[record],
        optim=Optim(lr=1e-2),
        batching=Batching(batch_size=8, micro_batch_size=1),
        loop=Loop(max_steps=1, progress=False),
        run=RunDir(path=out, loggers=()),
        hardware=Hardware(devices=devices, strategy=strategy),
    )
    return trainer, PromptData(rows(), processor=processor, shuffle=False), record


def vision_blocks_sharded(trainer) -> bool:
    blocks = trainer.policy.model.model.visual.blocks
    return all(isinstance(p, DTensor) for p in blocks.parameters())


def main(out, strategy, world_size):
    trainer, data, record = build(out, strategy, world_size)
    trainer.fit(data)
    if trainer.fabric.global_rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save({"steps": record.steps, "vision_sharded": vision_blocks_sharded(trainer)}, f"{out}/result.pt")
    trainer.fabric.barrier()  # gloo can abort at teardown unless every rank is done


def _forked_rank(rank, world_size, port, out, strategy):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main(out, strategy, world_size)


def run_forked(world_size, out, strategy, port):
    """The ranks as children forked from this (already warm) test process, with the environment torchrun
    gives them (rank, world size, rendezvous): no fresh interpreter imports torch and transformers again."""
    import torch.multiprocessing as mp

    mp.start_processes(_forked_rank, args=(world_size, port, str(out), strategy), nprocs=world_size,
                       start_method="fork")
    return torch.load(Path(out) / "result.pt", weights_only=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(os.environ.get("WORLD_SIZE", 1)))
