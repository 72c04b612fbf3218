"""Quantization-aware training under FSDP2 (2 processes, gloo): with float32 shards and bf16 compute, the engine is
sent exactly the bf16 fake-quantized weights the sharded model computed with (the fused layers' shared scale taken
over the whole tensors, not one shard)."""

from pathlib import Path

import torch

from tests.distributed.launch import run_ok

WORKER = Path(__file__).with_name("qat_worker.py")


def test_sharded_bf16_training_sends_the_weights_it_computes_with(tmp_path):
    result = run_ok(2, tmp_path, worker=WORKER)
    assert result["compute_dtypes"] == {"torch.bfloat16"}
    sent, computed = result["sent"], result["computed"]
    assert len(computed) == 14  # 7 linear layers in each of 2 decoder layers
    for name, weight in computed.items():
        for sync in ("first_sync", "sent"):  # before the first forward pass too (the engine's first load)
            assert result[sync][name].dtype == torch.bfloat16 and torch.equal(result[sync][name], weight), (sync, name)
    # the unsharded bf16 copy computes with the same weights; FSDP2 casts at its module boundaries: bf16 rounding apart
    torch.testing.assert_close(result["logits"], result["plain_logits"], atol=4e-3, rtol=0.02)
