"""Run by torchrun from test_parallelism.py: Ulysses sequence parallelism against one process, on every rank.

    python -m torch.distributed.run --nproc_per_node 2 ulysses_worker.py OUT

(test_parallelism.py runs it as a job of worker.py's launch: ``worker.py ulysses_worker OUT + ...``.)

For two head layouts (key/value heads split over the ranks, and repeated because there are
too few), each rank computes log-probs, entropy and critic values of the same packed batch
twice: on its own (the reference) and sequence-parallel over both ranks. Writes, on rank 0,
OUT/result.pt with the largest differences of outputs and of gradients (the sequence-parallel
gradients summed over ranks).
"""

import sys

import torch
import torch.distributed as dist

from rlflow.models import ulysses
from rlflow.models.critic import ValueHeadModel
from rlflow.models.logprobs import TokenLogProbs
from rlflow.models.tiny import tiny_qwen2


def batch(seed: int, B=5, P=7, R=9, vocab=20):
    g = torch.Generator().manual_seed(seed)
    prompt_ids, response_ids = torch.randint(1, vocab, (B, P), generator=g), torch.randint(1, vocab, (B, R), generator=g)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P)[None] >= P - prompt_len[:, None]).long()  # left padding
    resp_len = torch.randint(0, R + 1, (B,), generator=g)
    response_mask = (torch.arange(R)[None] < resp_len[:, None]).long()
    response_mask[0, 2] = 0  # a tool token inside a response
    return prompt_ids * prompt_mask, prompt_mask, response_ids, response_mask


def checkpointed(lm):
    lm.train()  # transformers checkpoints layers in training mode only
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm


def critic(lm):
    """A value model with a random head (the default zero head would give zero backbone gradients)."""
    model = ValueHeadModel(lm, remove_padding=True)
    torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(2))
    return model


def max_diff(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def compare(make, args, group, weights):
    """Outputs and summed gradients: one process vs sequence-parallel over ``group``."""
    ref, sp = make(), make()
    sp.sequence_parallel(group)
    out_ref, out_sp = ref(*args), sp(*args)
    out_ref, out_sp = (out_ref if isinstance(out_ref, tuple) else (out_ref,)), (out_sp if isinstance(out_sp, tuple) else (out_sp,))
    sum(((o * w).sum() for o, w in zip(out_ref, weights)), torch.zeros(())).backward()
    sum(((o * w).sum() for o, w in zip(out_sp, weights)), torch.zeros(())).backward()
    grad_diff = 0.0
    for (name, p), q in zip(ref.named_parameters(), sp.parameters()):
        if p.grad is None:
            continue
        g = q.grad.clone()
        dist.all_reduce(g, group=group)
        grad_diff = max(grad_diff, max_diff(g, p.grad))
    return {"out": max(max_diff(a, b) for a, b in zip(out_ref, out_sp)), "grad": grad_diff,
            "grad_norm": sum(p.grad.norm() ** 2 for p in ref.parameters() if p.grad is not None).item() ** 0.5}


def record_mask_choice(log: list):
    """Observe which attention mask each sequence-parallel forward used (plain causal or block-diagonal)."""
    choose = ulysses._one_sequence_per_row

    def observed(*args):
        log.append(choose(*args))
        return log[-1]

    ulysses._one_sequence_per_row = observed
    return choose


def main(out):
    if not dist.is_initialized():  # else a job of worker.py's launch: the group of the launch
        dist.init_process_group("gloo")
    causal_only = []
    original = record_mask_choice(causal_only)
    group = dist.new_group([0, 1])
    results = {}
    for heads, kv in ((4, 2), (2, 1)):  # kv heads split over 2 ranks; 1 kv head is repeated
        def lm():
            return tiny_qwen2(20, hidden_size=32, num_layers=2, num_heads=heads, num_kv_heads=kv,
                              intermediate_size=64, seed=0)
        args = batch(seed=heads)
        B, R = args[2].shape
        w = [torch.randn(B, R, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
        results[f"logprobs_h{heads}_kv{kv}"] = compare(
            lambda: TokenLogProbs(lm(), temperature=0.7, remove_padding=True), args, group, w)
        results[f"logprobs_packed_h{heads}_kv{kv}"] = compare(  # several sequences per packed row
            lambda: TokenLogProbs(lm(), remove_padding=True, pack_length=24), args, group, w)
        results[f"values_h{heads}_kv{kv}"] = compare(lambda: critic(lm()), args, group, w[:1])
        results[f"logprobs_checkpointed_h{heads}_kv{kv}"] = compare(  # layers recomputed in the backward pass
            lambda: TokenLogProbs(checkpointed(lm()), remove_padding=True, pack_length=24), args, group, w)
    try:
        TokenLogProbs(tiny_qwen2(20, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64)).sequence_parallel(group)
    except ValueError as e:
        results["padded_error"] = str(e)
    results["mask_choices"] = sorted(set(causal_only))
    ulysses._one_sequence_per_row = original  # the jobs after this one in the launch run unobserved
    if dist.get_rank() == 0:
        torch.save(results, f"{out}/result.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
