import json
import math

import pytest
import torch

from rlflow import GRPO, PPOLoss, keys as K
from rlflow.module import MissingKeyError

from .helpers import comparable, make_trainer, params


def test_grpo_steps_end_to_end_log_verl_metrics(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3, val_every=3)
    before = params(trainer.policy.model)
    history = trainer.fit(data)
    assert len(history) == 3
    last = history[-1]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac",
                 "actor/grad_norm", "response_length/mean", "timing_s/gen", "timing_s/update_actor",
                 "perf/throughput", "critic/advantages/mean", "val-core/rlflow/addition/reward/mean@1"):
        assert name in last and math.isfinite(last[name]), name
    assert "timing_s/old_log_prob" not in last  # one update per batch: the old policy is the current one
    assert any(not torch.equal(a, b) for a, b in zip(before, params(trainer.policy.model)))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_ppo_with_critic_updates_both(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, ppo=True, mini_batch_size=4, ppo_epochs=2)
    critic_before = params(trainer.critic.module)
    history = trainer.fit(data)
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "timing_s/old_log_prob",
            "timing_s/values", "timing_s/update_critic"} <= history[-1].keys()
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, params(trainer.critic.module)))


def test_chain_check_names_missing_key_and_module(model, tokenizer, addition_rows, tmp_path):
    with pytest.raises(MissingKeyError, match=r"loss \(PPOLoss\) reads 'ref_log_probs'"):
        make_trainer(model, tokenizer, addition_rows, tmp_path, loss=PPOLoss(kl_coef=0.1), reference=None)

    class NeedsBaseline(GRPO):
        in_keys = GRPO.in_keys + (K.REWARD_BASELINE,)

    with pytest.raises(MissingKeyError, match=r"estimator \(NeedsBaseline\) reads 'reward_baseline'"):
        make_trainer(model, tokenizer, addition_rows, tmp_path, estimator=NeedsBaseline())


def test_gae_without_critic_is_refused(model, tokenizer, addition_rows, tmp_path):
    from rlflow import GAE

    with pytest.raises(ValueError, match="needs a critic"):
        make_trainer(model, tokenizer, addition_rows, tmp_path, estimator=GAE())


def test_kl_loss_builds_a_reference_and_logs_kl(model, tokenizer, addition_rows, tmp_path):
    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, loss=PPOLoss(kl_coef=0.1))
    assert trainer.reference is not None
    history = trainer.fit(data)
    assert history[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert history[1]["actor/kl_loss"] > 0


@pytest.mark.parametrize("micro", [1, 4, 12])
def test_update_does_not_depend_on_micro_batch_size(model, tokenizer, addition_rows, tmp_path, micro):
    results = []
    for mb in (None, micro):
        trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path / str(mb), batch_size=6,
                                     micro_batch_size=mb, max_steps=1, loss=PPOLoss(agg="seq-mean-token-mean"))
        history = trainer.fit(data)
        results.append((params(trainer.policy.model), history[0]))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert results[0][1]["actor/pg_loss"] == pytest.approx(results[1][1]["actor/pg_loss"], abs=1e-6)
    assert results[0][1]["actor/grad_norm"] == pytest.approx(results[1][1]["actor/grad_norm"], rel=1e-4)


def test_non_finite_gradient_skips_the_step(model, tokenizer, addition_rows, tmp_path, recwarn):
    class Broken(GRPO):
        def compute(self, batch):
            adv, ret = super().compute(batch)
            return adv + float("nan"), ret

    trainer, data = make_trainer(model, tokenizer, addition_rows, tmp_path, estimator=Broken(), max_steps=1)
    before = params(trainer.policy.model)
    (metrics,) = trainer.fit(data)
    assert metrics["actor/skipped_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, params(trainer.policy.model)))
    # the schedule advances over a skipped step on purpose: no PyTorch warning about the order
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


def test_resume_continues_exactly(model, tokenizer, addition_rows, tmp_path):
    """Stopping at step 2 and resuming gives steps 3-4 identical to an uninterrupted run."""
    full, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "full", max_steps=4, save_every=2,
                              lr_schedule="cosine", warmup_steps=1)
    uninterrupted = full.fit(data)

    resumed, data = make_trainer(model, tokenizer, addition_rows, tmp_path / "resumed", max_steps=4,
                                 lr_schedule="cosine", warmup_steps=1,
                                 resume=tmp_path / "full" / "global_step_2")
    continued = resumed.fit(data)
    assert [m["training/global_step"] for m in continued] == [3, 4]
    for a, b in zip(uninterrupted[2:], continued):
        assert comparable(a) == comparable(b)
    for a, b in zip(params(full.policy.model), params(resumed.policy.model)):
        assert torch.equal(a, b)


def test_resume_auto_finds_latest_checkpoint(model, tokenizer, addition_rows, tmp_path):
    first, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=2, save_every=1)
    first.fit(data)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    again, data = make_trainer(model, tokenizer, addition_rows, tmp_path, max_steps=3, resume="auto")
    assert [m["training/global_step"] for m in again.fit(data)] == [3]
