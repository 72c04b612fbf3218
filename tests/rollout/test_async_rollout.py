"""AsyncRollout with the transformers engine in a forked child process: which weights sampled what, the
synchronous run reproduced at max_staleness=0, batches over the bound generated again, the batches ahead read
from the prompt stream, resume, and a run that fails (never hangs) when the generation process dies."""

import copy
import os
import re
import signal
import time

import pytest
import torch

from rlflow import FunctionReward, Policy, PPOLoss, PromptData, Trainer, Batching, Loop, Optim, RunDir
from rlflow.algorithms import GRPO, TruncatedIS
from rlflow.data import keys as K
from rlflow.module import Chain
from rlflow.rollout import AsyncRollout, HFRollout, ServerRollout
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.engines.process import EngineProcessError, ProcessEngine
from rlflow.rollout.engines.base import SamplingParams
from rlflow.tasks.addition import AdditionTask
from rlflow.trainer.options import with_groups
from tests.rollout.conftest import requires_vllm

GREEDY = SamplingParams(n=1, max_new_tokens=4, greedy=True)


def longer_is_better(solution_str, ground_truth):
    """A reward the untrained tiny model's samples differ on (exact match would be 0 for all: no update)."""
    return len(solution_str.strip()) / 4


class Recorder:
    """Keeps every step's batch and the weights after every update (``weights[v]``: version v)."""

    def __init__(self):
        self.batches, self.weights = [], []

    def on_fit_start(self, trainer):
        self.weights.append(copy.deepcopy(trainer.policy.model.state_dict()))

    def on_rollout_end(self, trainer, batch):
        self.batches.append(batch.clone())

    def on_step_end(self, trainer, step, metrics):
        self.weights.append(copy.deepcopy(trainer.policy.model.state_dict()))


def make_trainer(model, tokenizer, rows, tmp_path, rollout, steps=3, callbacks=(), **kwargs):
    return Trainer(
        policy=Policy(model, tokenizer), rollout=rollout, reward=FunctionReward(longer_is_better),
        estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True), callbacks=list(callbacks),
        **with_groups(batch_size=4, lr=5e-2, max_steps=steps, run_dir=tmp_path, loggers=(), progress=False, **kwargs),
    )


def recomputed(model, tokenizer, weights, batch):
    """The batch's response log-probs under ``weights`` (a state dict of ``model``'s architecture)."""
    twin = copy.deepcopy(model)
    twin.load_state_dict(weights)
    return Policy(twin, tokenizer)(batch.clone())[K.OLD_LOG_PROBS]


def push_two_updates(rollout, model):
    """Move ``model``'s weights twice, pushing each to ``rollout``: the batch generated ahead falls two versions behind."""
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        rollout.sync_weights(model)


def test_one_step_off_samples_come_from_the_weights_one_update_back(model, tokenizer, addition_rows, tmp_path):
    """Batch t (t >= 1) was sampled while step t-1 trained, with the weights of version t-1: its rollout
    log-probs are those weights' log-probs (and not the current ones'), and it says so in policy_version."""
    recorder = Recorder()
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=1)
    trainer = make_trainer(model, tokenizer, addition_rows[0], tmp_path, rollout, steps=4, callbacks=[recorder])
    process = rollout.engine.process
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
    finally:
        rollout.close()
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        version = max(step - 1, 0)
        assert batch[K.POLICY_VERSION].tolist() == [version] * 8
        mask = batch[K.RESPONSE_MASK].bool()
        sampled = batch[K.ROLLOUT_LOG_PROBS][mask]
        assert (recomputed(model, tokenizer, recorder.weights[version], batch)[mask] - sampled).abs().max() < 1e-5
        if version < step:  # the trainer's current weights give other log-probs: the samples are one update old
            assert (recomputed(model, tokenizer, recorder.weights[step], batch)[mask] - sampled).abs().max() > 1e-3
        assert metrics["async/staleness_max"] == metrics["async/staleness_mean"] == step - version
        assert metrics["async/over_bound_frac"] == 0 and metrics["async/mispredicted_batches"] == 0
        assert metrics["timing_s/gen_wait"] >= 0 and metrics["timing_s/train_wait"] >= 0
        assert metrics["rollout_corr/rollout_is_mean"] > 0  # the correction saw these samples
    assert not process.is_alive()


def test_max_staleness_zero_reproduces_the_synchronous_run(model, tokenizer, addition_rows, tmp_path):
    """The engine in its own process, nothing generated ahead: the same samples, losses, gradients and
    validation as generating in the trainer's process."""
    data = PromptData(addition_rows[0], val=addition_rows[1], seed=0)
    runs = {}
    for name in ("sync", "async"):
        inner = HFRollout(n=2, max_new_tokens=4)
        rollout = inner if name == "sync" else AsyncRollout(inner, max_staleness=0)
        trainer = make_trainer(copy.deepcopy(model), tokenizer, addition_rows[0], tmp_path / name, rollout)
        runs[name] = (trainer.fit(data), trainer.validate(data))
        if name == "async":
            rollout.close()
    (sync, sync_val), (asynchronous, async_val) = runs["sync"], runs["async"]
    for expected, got in zip(sync, asynchronous):
        shared = [k for k in expected if not k.startswith(("timing_s/", "perf/", "weight_sync/"))]
        assert shared and {k: got[k] for k in shared} == {k: expected[k] for k in shared}
        assert got["async/staleness_max"] == 0
    assert async_val == sync_val


def test_batches_over_the_bound_are_generated_again_and_the_batches_ahead_are_read_from_the_stream(
        model, tokenizer, addition_rows):
    """The engine reads the batches it generates ahead from the prompt iterator itself: a plain generator (which
    cannot be copied, so nothing can be guessed) works, one batch is drawn ahead, and every batch of samples is
    of the prompts drawn in that order. Weights pushed twice for one batch leave the batch generated ahead two
    versions behind (> 1): it is generated again with the newest weights and counted."""
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=1)
    rollout.bind(model, tokenizer)
    loader, drawn = PromptData(addition_rows[0], seed=0).loader(4, tokenizer), []

    def prompts():
        while True:
            drawn.append(next(loader))
            yield drawn[-1]

    policy, stream = Policy(model, tokenizer), rollout.stream(prompts())
    try:
        first = next(stream)
        assert len(drawn) == 2 and len(rollout.in_flight) == 1  # batch 0 sampled, batch 1 in flight
        assert first[K.POLICY_VERSION].tolist() == [0] * 8 and rollout.stats["async/over_bound_frac"] == 0
        push_two_updates(rollout, model)
        again = next(stream)
        assert rollout.stats["async/over_bound_frac"] == 1 and rollout.stats["async/regenerated_samples"] == 8
        assert again[K.POLICY_VERSION].tolist() == [2] * 8 and rollout.stats["async/staleness_max"] == 0
        mask = again[K.RESPONSE_MASK].bool()
        assert (policy(again.clone())[K.OLD_LOG_PROBS] - again[K.ROLLOUT_LOG_PROBS])[mask].abs().max() < 1e-5
        third = next(stream)  # submitted after both pushes: sampled with version 2
        assert third[K.POLICY_VERSION].tolist() == [2] * 8 and rollout.stats["async/mispredicted_batches"] == 0
        for samples, batch in zip((first, again, third), drawn):
            assert torch.equal(samples[K.PROMPT_IDS][::2], batch[K.PROMPT_IDS])
        greedy = rollout.with_options(n=1, do_sample=False)(next(loader))  # validation: through the same engine
        expected = HFEngine(model, tokenizer).generate_padded(greedy[K.PROMPT_IDS], greedy[K.PROMPT_MASK],
                                                              GREEDY)[0]
        assert torch.equal(greedy[K.RESPONSE_IDS][:, :expected.shape[1]], expected)
        stream.close()
        assert not rollout.in_flight  # closing the stream cancels the batch generated ahead
    finally:
        rollout.close()


def test_resume_regenerates_the_batches_in_flight(model, tokenizer, addition_rows, tmp_path):
    """Checkpoints hold the policy version, not the batches in flight: the first step after a resume samples
    with the restored weights (0 versions behind), then the pipeline is one step off again, on the prompts an
    uninterrupted run trains on."""
    initial = copy.deepcopy(model.state_dict())
    data = PromptData(addition_rows[0], seed=0)
    whole = Recorder()
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4))
    try:
        make_trainer(model, tokenizer, addition_rows[0], tmp_path, rollout, steps=4, save_every=2,
                     callbacks=[whole]).fit(data)
    finally:
        rollout.close()
    model.load_state_dict(initial)
    resumed = Recorder()
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4))
    trainer = make_trainer(model, tokenizer, addition_rows[0], tmp_path, rollout, steps=4, callbacks=[resumed],
                           resume=tmp_path / "global_step_2")
    try:
        history = trainer.fit(data)
    finally:
        rollout.close()
    assert [m["training/global_step"] for m in history] == [3, 4]
    assert [m["async/staleness_max"] for m in history] == [0, 1]
    assert [b[K.POLICY_VERSION][0].item() for b in resumed.batches] == [2, 2]
    for before, after in zip(whole.batches[2:], resumed.batches):
        assert torch.equal(before[K.PROMPT_IDS], after[K.PROMPT_IDS])


class Kill:
    """SIGKILLs the engine's process at the end of the given steps (as the OOM killer would), and reaps it."""

    def __init__(self, *steps):
        self.steps, self.at = steps, None

    def on_step_end(self, trainer, step, metrics):
        if step in self.steps:
            process = trainer.rollout.engine.process
            os.kill(process.pid, signal.SIGKILL)
            process.join(10)
            self.at = time.monotonic()


@pytest.mark.timeout(120)
def test_a_killed_generation_process_is_restarted_and_the_run_finishes(model, tokenizer, addition_rows, tmp_path,
                                                                       caplog):
    """The engine's process is killed after step 1: a new one starts with the newest weights pushed and the
    batches the dead one had not answered (at least the one sent to it after it died). The run trains on the
    prompt stream's batches in order (none lost or repeated), every batch's log-probs are those of the weights
    it reports (so the new engine holds the policy's weights), one warning names the cause, and the metrics
    count the restart."""
    import logging

    caplog.set_level(logging.WARNING, logger="rlflow.rollout.engines")
    recorder, kill = Recorder(), Kill(1)
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=1)
    trainer = make_trainer(model, tokenizer, addition_rows[0], tmp_path, rollout, steps=4, callbacks=[recorder, kill])
    first = rollout.engine.process
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
        restarted = rollout.engine.process
    finally:
        rollout.close()
    assert restarted is not first and not restarted.is_alive()
    assert "rollout/engine_restarts" not in history[0] and history[-1]["rollout/engine_restarts"] == 1
    expected = PromptData(addition_rows[0], seed=0).loader(4, tokenizer)
    for step, batch in enumerate(recorder.batches):
        assert torch.equal(batch[K.PROMPT_IDS], next(expected)[K.PROMPT_IDS].repeat_interleave(2, 0)), step
        version = batch[K.POLICY_VERSION][0].item()
        # the one-step-off version, or the newest one if the dead child had not sampled this batch yet
        assert batch[K.POLICY_VERSION].tolist() == [version] * 8 and max(step - 1, 0) <= version <= step
        mask = batch[K.RESPONSE_MASK].bool()
        sampled = batch[K.ROLLOUT_LOG_PROBS][mask]
        assert (recomputed(model, tokenizer, recorder.weights[version], batch)[mask] - sampled).abs().max() < 1e-5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "restart" in r.getMessage()]
    assert len(warnings) == 1 and re.search(r"generation process \(pid \d+\) was killed by SIGKILL", warnings[0])
    assert "(restart 1 of at most 2, max_engine_restarts)" in warnings[0]


@pytest.mark.timeout(120)
def test_a_dead_generation_process_past_max_engine_restarts_fails_the_run_with_a_clear_error(
        model, tokenizer, addition_rows, tmp_path):
    """With max_engine_restarts=0 the first death fails the next step, naming the process, the signal and what
    to check, instead of waiting for samples that will never come."""
    kill = Kill(1)
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=1, max_engine_restarts=0)
    trainer = make_trainer(model, tokenizer, addition_rows[0], tmp_path, rollout, steps=3, callbacks=[kill])
    try:
        with pytest.raises(EngineProcessError, match=r"generation process \(pid \d+\) was killed by SIGKILL") as e:
            trainer.fit(PromptData(addition_rows[0], seed=0))
        # noticed by the next wait on the child (polled every 0.5 s), not by the hour-long timeout; a bound on
        # hanging, not a performance figure (measured 0.05 s)
        assert time.monotonic() - kill.at < 30
        message = str(e.value)
        assert "HFRollout's HFEngine" in message and "max_engine_restarts=0" in message
        assert "memory" in message and "dmesg" in message and "log" in message
    finally:
        rollout.close()
    with pytest.raises(ValueError, match="max_engine_restarts must be an integer >= 0, got -1"):
        ProcessEngine(HFEngine, model, tokenizer, max_restarts=-1)


@pytest.mark.timeout(60)
def test_a_generation_process_that_stops_answering_fails_after_the_timeout(model, tokenizer):
    """A child that is alive but silent (stopped) is not waited on forever: after ``timeout`` seconds the call
    raises and the child is stopped."""
    engine = ProcessEngine(HFEngine, model, tokenizer, timeout=2.0)
    try:
        prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
        engine.generate([prompt], GREEDY)  # started and answering
        os.kill(engine.process.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineProcessError, match=r"gave no answer within 2 s .* it was stopped"):
            engine.generate([prompt], GREEDY)
        assert time.monotonic() - start < 30  # the timeout, plus stopping the child; not a performance figure
    finally:
        engine.close()
    assert not engine.process.is_alive()


def test_the_engine_process_reports_a_failed_start_and_keeps_pushed_weights_in_order(model, tokenizer):
    """An engine that cannot start fails the first call with its traceback. With one weight slot, three pushes
    in a row each wait for the child to load the previous one: it samples with the last, tagged version 3."""
    def broken(model, tokenizer):
        raise RuntimeError("no engine today")

    failing = ProcessEngine(broken, model, tokenizer)
    with pytest.raises(EngineProcessError, match="no engine today"):
        failing.generate([[1, 2, 3]], GREEDY)
    failing.close()

    engine = ProcessEngine(HFEngine, model, tokenizer, slots=1)
    try:
        for _ in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            engine.load_weights([list(model.named_parameters())])
        prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
        (completion,), = engine.generate([prompt], GREEDY)
        assert completion.extras["policy_version"] == 3
        here = HFEngine(model, tokenizer).generate([prompt], GREEDY)[0][0]
        assert completion.token_ids == here.token_ids
        assert max(abs(a - b) for a, b in zip(completion.log_probs, here.log_probs)) < 1e-5
    finally:
        engine.close()
    assert not engine.process.is_alive()


@requires_vllm
def test_a_server_is_driven_one_step_off_from_a_thread(vllm_server, vllm_model_dir, tmp_path):
    """A vLLM server under AsyncRollout: no process of ours, a thread asks it; from the second step each batch
    is one version old, and the server's log-probs are those of the weights the batch says sampled it."""
    policy = Policy.from_pretrained(vllm_model_dir)
    recorder = Recorder()
    rollout = AsyncRollout(ServerRollout(vllm_server, n=2, max_new_tokens=4, checkpoint_dir=tmp_path / "weights"))
    assert rollout.placement == "thread"
    trainer = make_trainer(policy.model, policy.tokenizer, None, tmp_path, rollout, steps=3, callbacks=[recorder])
    try:
        history = trainer.fit(PromptData(AdditionTask().splits()[0][:16], seed=0))
    finally:
        rollout.close()
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        version = max(step - 1, 0)
        assert batch[K.POLICY_VERSION].tolist() == [version] * 8 and metrics["async/staleness_max"] == step - version
        mask = batch[K.RESPONSE_MASK].bool()
        theirs = recomputed(policy.model, policy.tokenizer, recorder.weights[version], batch)[mask]
        assert (theirs - batch[K.ROLLOUT_LOG_PROBS][mask]).abs().max() < 1e-4


def test_a_lora_policy_runs_beside_training_with_transformers_and_is_refused_elsewhere(model, tokenizer, addition_rows,
                                                                                         tmp_path):
    """With LoRA the child holds a PEFT copy and takes the adapter's pushes: at max_staleness=0 every sample
    comes from the current weights (importance ratios 1). An engine that needs merged weights is refused."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    rollout = AsyncRollout(HFRollout(n=2, max_new_tokens=4), max_staleness=0)
    trainer = Trainer(
        policy=Policy(copy.deepcopy(model), tokenizer, lora=lora), rollout=rollout,
        reward=FunctionReward(longer_is_better), estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True),
        optim=Optim(lr=5e-2), batching=Batching(batch_size=4), loop=Loop(max_steps=3, progress=False),
        run=RunDir(path=tmp_path, loggers=()),
    )
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
    finally:
        rollout.close()
    assert any(m["actor/grad_norm"] > 0 for m in history[:-1])  # the adapter moved, and was pushed
    for m in history:
        assert abs(m["rollout_corr/rollout_is_min"] - 1) < 1e-4 and abs(m["rollout_corr/rollout_is_max"] - 1) < 1e-4
    served = AsyncRollout(ServerRollout("http://127.0.0.1:9", n=2, max_new_tokens=4))
    with pytest.raises(NotImplementedError, match="LoRA policy"):
        served.bind(Policy(copy.deepcopy(model), tokenizer, lora=lora).model, tokenizer)
