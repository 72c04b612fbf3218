"""Run by torchrun from test_server_fleet.py: one fleet per gloo process, sharing the same two servers.

    python -m torch.distributed.run --nproc_per_node 2 fleet_worker.py MODEL_DIR OUT GOOD_URL BAD_URL

Every rank binds its fleet to the same model and sends the weights twice (the second update the bad server
refuses), then samples. Each rank writes OUT/rank{R}.json: why each server is out, and the call's metrics.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from rlflow import Policy
from rlflow.rollout.engines import SamplingParams
from rlflow.rollout.engines.base import hf_weight_buckets
from rlflow.rollout.engines.fleet import FleetEngine
from rlflow.rollout.engines.server import ServerEngine

model_dir, out, urls = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
dist.init_process_group("gloo")
policy = Policy.from_pretrained(model_dir)
fleet = FleetEngine([ServerEngine(url, eos_token_ids=(policy.tokenizer.eos_token_id,), retries=0) for url in urls])
for _ in range(2):
    synced = fleet.load_weights(hf_weight_buckets(policy.model))["rollout/servers_synced"]
prompts = [policy.tokenizer(t)["input_ids"] for t in ("1+2=", "3+4=", "5+6=", "7+8=")]
fleet.generate(prompts, SamplingParams(n=1, max_new_tokens=3, seed=dist.get_rank()))
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"out": fleet.out_reason, "synced": synced,
                                                             "stats": fleet.stats}))
fleet.close()
dist.destroy_process_group()
