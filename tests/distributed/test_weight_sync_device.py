"""Where the weight-sync collective runs: on the shards' device when the process group's backend serves it,
else on a device it does serve (FSDP2's CPU offload under NCCL: the GPU). The GPU case itself is
``test_gpu.py`` (not run without CUDA); here the choice and a real gloo group on CPU."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from rlflow.rollout.weight_sync import collective_device, full_weight_buckets, pick_device


def test_pick_device():
    cpu = torch.device("cpu")
    assert pick_device(["cpu"], cpu) == cpu
    assert pick_device(["cuda", "cpu"], cpu) == cpu  # gloo serves both: no copy
    assert pick_device(["cuda"], cpu).type == "cuda"  # NCCL: CPU-offloaded shards move to the GPU
    assert pick_device(["cuda"], torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_gloo_group_gathers_on_cpu():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert collective_device(dist.group.WORLD, torch.device("cpu")) == torch.device("cpu")
        mesh = init_device_mesh("cpu", (1,))
        assert collective_device(mesh.get_group(), torch.device("cpu")) == torch.device("cpu")
        model = torch.nn.Linear(3, 5)
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        for name, p in list(model.named_parameters()):
            setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        got = {n: t for bucket in full_weight_buckets(model) for n, t in bucket}
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) and got[n].device.type == "cpu" for n in expected)
    finally:
        dist.destroy_process_group()
