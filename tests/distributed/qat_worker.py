"""Run by torchrun from test_qat_fsdp2.py: quantization-aware training under FSDP2 with bf16 compute.

    python -m torch.distributed.run --nproc_per_node 2 qat_worker.py OUT

A tiny model with NVFP4 fake-quantized linears (rlflow.models.qat) is sharded over 2 processes with rlflow's FSDP2
(fsdp2_parallelize), its parameters float32 and its compute bfloat16, and scores a batch; then its weights are gathered
in buckets for an engine, before and after that pass. Rank 0 writes OUT/result.pt: the bf16 weights each quantized layer computed with (from an
unsharded bf16 copy: the same values), the weights the buckets carried, and both logits.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rlflow.models.qat import NVFP4Linear, apply_qat, nvfp4_fake_quantize
from rlflow.models.tiny import tiny_qwen2
from rlflow.strategies.fsdp2 import fsdp2_parallelize
from rlflow.weights import hf_weight_buckets


def main(out):
    dist.init_process_group("gloo")
    model = tiny_qwen2(21, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=48, seed=3)
    apply_qat(model)
    unsharded = copy.deepcopy(model).bfloat16()
    fsdp2_parallelize(model, init_device_mesh("cpu", (2,)), param_dtype=torch.bfloat16)
    first_sync = {n: t for bucket in hf_weight_buckets(model) for n, t in bucket}  # before any forward pass
    ids = torch.arange(12).reshape(2, 6) % 21
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        plain_logits = unsharded(input_ids=ids).logits
    sent = {n: t for bucket in hf_weight_buckets(model) for n, t in bucket}
    computed = {}
    for name, layer in unsharded.named_modules():
        if isinstance(layer, NVFP4Linear):
            computed[f"{name}.weight"] = nvfp4_fake_quantize(layer.weight, layer.global_amax(), layer.group_size)
    if dist.get_rank() == 0:
        torch.save({"sent": sent, "first_sync": first_sync, "computed": computed, "logits": logits, "plain_logits": plain_logits,
                    "compute_dtypes": {str(m.compute_dtype) for m in model.modules() if isinstance(m, NVFP4Linear)}},
                   f"{out}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
