"""Step metrics reduced across processes: rlflow's ``reduce_metrics`` vs a torchmetrics ``MetricCollection``.

    python benchmarks/metric_reduction.py        # --metrics 50 --repeats 20 (2 CPU processes, gloo)

Each of 2 processes (gloo on 127.0.0.1) holds ``--metrics`` step metrics (a fifth named ``*/max``, a fifth
``*/min``, the rest means) and reduces them to one value per metric for the whole job, as the Trainer does
after every step: ``rlflow.trainer.distributed.reduce_metrics`` (one ``all_gather`` of a vector of every
metric) against a torchmetrics ``MetricCollection`` of ``MeanMetric`` / ``MaxMetric`` / ``MinMetric`` (updated
with the step's values, then ``compute()``, which syncs each metric's states, then ``reset()``). Both give the
same values (checked). The two alternate; reported: the median milliseconds per step on rank 0 and their
ratio. Writes benchmarks/metric_reduction.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def step_metrics(count: int, rank: int, step: int) -> dict[str, float]:
    kinds = ["max" if i % 5 == 0 else "min" if i % 5 == 1 else "mean" for i in range(count)]
    return {f"m{i}/{kind}": float((i + 1) * (rank + 1) + step) for i, kind in enumerate(kinds)}


def worker(rank: int, port: int, count: int, repeats: int, out: str) -> None:
    from torchmetrics import MaxMetric, MeanMetric, MetricCollection, MinMetric

    from rlflow.trainer.distributed import reduce_metrics

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    fabric = SimpleNamespace(world_size=2)  # all reduce_metrics reads of a Fabric
    kinds = {"max": MaxMetric, "min": MinMetric, "mean": MeanMetric}
    names = list(step_metrics(count, rank, 0))
    collection = MetricCollection({n.replace("/", "_"): kinds[n.split("/")[1]]() for n in names}, compute_groups=False)
    times = {"rlflow reduce_metrics": [], "torchmetrics MetricCollection": []}
    for step in range(repeats):
        metrics = step_metrics(count, rank, step)
        dist.barrier()
        t0 = time.perf_counter()
        ours = reduce_metrics(fabric, metrics)
        times["rlflow reduce_metrics"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        for name, value in metrics.items():
            collection[name.replace("/", "_")].update(torch.tensor(value, dtype=torch.float64))
        theirs = {k: float(v) for k, v in collection.compute().items()}
        collection.reset()
        times["torchmetrics MetricCollection"].append(time.perf_counter() - t0)
        for name in names:
            assert math.isclose(ours[name], theirs[name.replace("/", "_")], rel_tol=1e-6), (name, ours, theirs)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(__file__).with_suffix(".times.tmp")
    mp.spawn(worker, args=(port, args.metrics, args.repeats, str(out)), nprocs=2)
    times = json.loads(out.read_text())
    out.unlink()
    med = {k: statistics.median(v[1:]) * 1000 for k, v in times.items()}  # the first call sets up
    ours, theirs = med["rlflow reduce_metrics"], med["torchmetrics MetricCollection"]
    report = {"median_ms": med, "ratio_torchmetrics_over_rlflow": theirs / ours, "metrics": args.metrics,
              "repeats": args.repeats, "load_average": os.getloadavg()}
    for k, v in med.items():
        print(f"{k:32} {v:8.2f} ms per step")
    print(f"torchmetrics / rlflow = {theirs / ours:.1f}x ({args.metrics} metrics, 2 gloo processes, "
          f"load average {report['load_average'][0]:.1f})")
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
