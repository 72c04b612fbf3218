"""verl's sequence-parallel and balancing keys reach the Trainer, or fail with a clear message."""

import pytest

from rlflow.config.verl.loading import ConfigError, load_config
from rlflow.config.verl.plan import make_plan

A = "actor_rollout_ref.actor"
BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "trainer.device=cpu",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=grpo"]


def plan(*overrides):
    return make_plan(load_config([*BASE, *overrides]))


def test_ulysses_size_and_balance_batch_reach_the_trainer():
    p = plan(f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true",
             "trainer.balance_batch=false")
    assert p.trainer_kwargs["sequence_parallel_size"] == 2  # the ref's size follows the actor's (verl's default)
    assert p.trainer_kwargs["balance_batch"] is False
    assert plan().trainer_kwargs["sequence_parallel_size"] == 1
    assert plan().trainer_kwargs["balance_batch"] is True


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"],
     "actor_rollout_ref.model.use_remove_padding=True"),
    ([f"{A}.ulysses_sequence_parallel_size=3", "actor_rollout_ref.model.use_remove_padding=true"],
     "must divide the number of processes (2)"),
    (["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"], "one sequence-parallel size for every role"),
])
def test_bad_sequence_parallel_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        plan(*overrides)
    assert message in str(err.value)


def test_a_critic_with_another_size_gets_a_note():
    p = plan("algorithm.adv_estimator=gae", "critic.model.path=m", f"{A}.ulysses_sequence_parallel_size=2",
             "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true")
    assert p.trainer_kwargs["sequence_parallel_size"] == 2
    assert any("applies to every role" in n and "critic.ulysses_sequence_parallel_size=1" in n for n in p.notes)
