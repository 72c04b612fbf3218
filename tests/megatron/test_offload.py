"""verl's Megatron CPU offload (``megatron.{param,grad,optimizer}_offload``, ``rlflow.strategies.megatron.offload``).

On CPU there is no second device to move to: the moves are no-ops, and what is checked is the strategy's bookkeeping
of where each role's tensors are (the same code that decides the moves on a GPU) over a real 2-rank gloo run, the
verl keys' path to the strategy, and the move functions on this device. ``test_gpu.py`` checks the real moves.
"""

import pytest
import torch

import rlflow.config.verl.devices as devices
from rlflow.config.verl.loading import load_config
from rlflow.config.verl.plan import make_plan
from rlflow.strategies.megatron import MegatronStrategy, megatron_available
from rlflow.strategies.megatron.offload import grads_to, optimizer_state_to, params_to

from . import optimizer_scenarios  # noqa: F401  (its scenarios, for the forked ranks)
from .forked import fork_launch
from .test_megatron import assert_same_run

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")

A = "actor_rollout_ref.actor"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return fork_launch(2, tmp_path_factory.mktemp("offload"), ("offload_tp",))["offload_tp"]


def test_each_role_runs_with_its_tensors_on_the_device_and_the_others_on_the_host(runs):
    """A role's forward (log-prob, value and update passes) finds its own tensors on the device and every other role's
    on the host; after each RL step (the policy's weight export ends it) all are on the host."""
    run = runs["offload"]
    assert run["seen"] == [("critic", ("policy", "reference")), ("policy", ("critic", "reference")),
                           ("reference", ("critic", "policy"))]
    assert run["after_step"] == [["critic", "policy", "reference"]] * 2
    assert run["optimizer_roles"] == ["critic", "policy"]  # each optimizer's states move with its role


def test_offloaded_run_equals_the_plain_run(runs):
    assert runs["plain"]["seen"] == []  # nothing tracked without offload
    assert_same_run(runs["offload"]["steps"], runs["plain"]["steps"], steps=(1, 2), atol=0)


def test_moves_keep_parameters_and_optimizer_state_in_place():
    """The move functions swap ``.data`` and state entries: the Parameter objects, and the optimizer's state keyed by
    them, stay; values round-trip exactly (on this machine's only device, a no-op move)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    params, before = list(model.parameters()), [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    for device in (torch.device("cpu"), torch.device("cpu")):
        params_to(params, device)
        grads_to(params, device)
        optimizer_state_to(optimizer, device)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(optimizer.state[p][k], v) for p in params for k, v in state[id(p)].items())


@pytest.mark.parametrize("device, gpus", [("cpu", 0), ("cuda", 1)])
def test_verl_offload_keys_reach_the_strategy(monkeypatch, device, gpus):
    """Once refused on GPUs ('offloading Megatron states to the CPU'); now each role's keys become its offload."""
    monkeypatch.setattr(devices, "cuda_count", lambda: gpus)
    cfg = load_config(["actor_rollout_ref.model.path=/nowhere", "algorithm.adv_estimator=gae", "critic.model.path=/x",
                       "trainer.logger=[console]", f"{A}.strategy=megatron", "trainer.n_gpus_per_node=1",
                       f"trainer.device={device}", f"{A}.megatron.param_offload=true", f"{A}.megatron.grad_offload=true",
                       f"{A}.megatron.optimizer_offload=true", "critic.megatron.optimizer_offload=true"])
    plan = make_plan(cfg)
    # verl's tree points the reference's and the critic's param_offload at the actor's
    assert plan.trainer_kwargs["strategy"].offload == {
        "policy": ["params", "grads", "optimizer"], "reference": ["params"], "critic": ["params", "optimizer"]}
    assert any("pinned host memory" in n if device == "cuda" else "already live in CPU memory" in n for n in plan.notes)
    with pytest.raises(ValueError, match="offload with distributed_optimizer=True"):
        MegatronStrategy(distributed_optimizer=True, offload={"policy": ["params"]})
    with pytest.raises(ValueError, match=r"offload=\{'actor': \['params'\]\}: roles"):
        MegatronStrategy(offload={"actor": ["params"]})


def test_dry_run_peak_leaves_out_an_offloaded_reference(tmp_path, capsys):
    from rlflow.config.verl.run import main

    from .test_precision_aware_megatron import dry_run_argv

    argv = dry_run_argv(tmp_path) + [f"{A}.use_kl_loss=true"]
    assert main(argv) == 0
    assert "model states + reference + activations" in capsys.readouterr().out
    assert main(argv + ["actor_rollout_ref.ref.megatron.param_offload=true"]) == 0
    out = capsys.readouterr().out
    assert "model states + activations (the reference waits on the host" in out
