"""MoE routing replay (verl's router_replay.mode=R2 and R3; strategies/megatron/router_replay.py) on two CPU processes.

One launch of two forked ranks runs ``moe_replay`` (R2) and ``moe_rollout_replay`` (R3: the routing the HF rollout
recorded): a Qwen3-MoE-shaped model (4 experts, top 2) at expert parallel 2, with and without replay, and two GRPO
steps in the Trainer with replay.
"""

import pytest

from rlflow.strategies.megatron import megatron_available

from . import lora_scenarios, routing_scenarios  # noqa: F401  (their scenarios, for the forked ranks)
from .forked import fork_launch

pytestmark = pytest.mark.skipif(not megatron_available(),
                                reason="megatron-core is not installed (pip install -e '.[megatron]')")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron-replay")
    routing_scenarios.verl_moe_inputs(out / "verl_moe")
    return fork_launch(2, out, ["moe_replay", "moe_rollout_replay", "moe_r3_verl"])


@pytest.fixture(scope="module")
def replay(launch):
    return launch["moe_replay"]


@pytest.fixture(scope="module")
def rollout_replay(launch):
    return launch["moe_rollout_replay"]


def test_the_update_routes_as_the_old_log_prob_pass_recorded_after_the_weights_change(replay):
    """The pass without gradients records; the routers' weights then change; the pass with gradients, its rows in
    another order, sends every real token of both MoE layers to the recorded experts, while without replay the
    same change reroutes tokens (so the comparison can see a difference)."""
    assert replay["replay"]["same"] == [True, True]
    assert replay["plain"]["same"] != [True, True]
    assert replay["replay"]["grads"] and replay["plain"]["grads"]


def test_the_trainer_records_in_the_old_log_prob_pass_and_replays_in_the_update(replay):
    """GRPO with two mini-batches per step (so old log-probs are computed, and the second update runs on weights the
    first changed), expert parallel 2 (so 2 data-parallel ranks, which share their records: balance_batch may
    move rows between them): each step records its 8 rows per rank and replays 8."""
    trainer = replay["trainer"]
    assert trainer["counts"] == {"recorded": 16, "replayed": 16}
    assert all(g > 0 for g in trainer["grad_norm"])


def test_r3_the_update_routes_every_token_to_the_experts_the_rollout_chose_after_the_weights_change(rollout_replay):
    """The HF rollout recorded each token's experts while it generated (all but each full-length row's last token,
    which is never fed back); the routers' weights then change; the Megatron pass with gradients, its rows in another
    order, sends every recorded token of both MoE layers to the rollout's experts, while without replay the same
    change reroutes tokens."""
    assert rollout_replay["unrouted"] > 0  # the last token of the rows that ran to max_new_tokens
    assert rollout_replay["R3"]["same"] == [True, True] and rollout_replay["R3"]["tokens"] > 0
    assert rollout_replay["plain"]["same"] != [True, True]
    assert rollout_replay["R3"]["grads"] and rollout_replay["plain"]["grads"]


def test_r3_at_pipeline_parallel_each_stage_replays_its_own_layers_routing(rollout_replay):
    """At pipeline parallel 2 each stage holds one MoE layer: the pass without gradients (the old-log-prob pass)
    routes every recorded token of each to the rollout's experts for that layer, after the same router change."""
    assert rollout_replay["R3_pp"]["same"] == [True, True]
    assert rollout_replay["R3_pp"]["tokens"] == rollout_replay["R3"]["tokens"] > 0


def test_r3_the_trainer_replays_the_rollouts_routing_in_the_old_log_prob_pass_and_the_update(rollout_replay):
    """GRPO with two mini-batches per step at expert parallel 2 (8 rows per rank and step): the old-log-prob pass and
    the updates both replay the rollout's routing (8 + 8 rows per step), nothing is recorded."""
    trainer = rollout_replay["trainer"]
    assert trainer["counts"] == {"recorded": 0, "replayed": 32}
    assert all(g > 0 for g in trainer["grad_norm"])


def test_verls_r3_keys_train_through_main_ppo(launch, capsys):
    """actor.megatron.router_replay.mode=R3 with rollout.enable_rollout_routing_replay=True and rollout.name=hf at
    expert parallel 2: one GRPO step runs (its update stops on a batch without the rollout's routing)."""
    assert launch["moe_r3_verl"]["code"] == 0
