"""FullyAsyncRollout with the transformers engine: a response that spans two weight versions has, per token, the
log-prob of the weights that sampled it; a run keeps every sample within max_off_policy_threshold and logs verl's
off-policy metrics; threshold 1 trains every token on the weights it was sampled with."""

import copy
import json
import multiprocessing
import os
import signal

import pytest
import torch

from rlflow import Batching, FunctionReward, Loop, Optim, Policy, PPOLoss, PromptData, RunDir, Trainer
from rlflow.algorithms import GRPO, TruncatedIS
from rlflow.data import keys as K
from rlflow.module import Chain
from rlflow.rollout import FullyAsyncRollout, HFRollout
from rlflow.rollout.engines.base import SamplingParams, hf_weight_buckets
from rlflow.rollout.engines.hf import HFEngine
from rlflow.rollout.fully_async import Sample, generate_chunk
from tests.rollout.conftest import ENGINE_OPTIONS, requires_vllm
from tests.rollout.test_async_rollout import Recorder, longer_is_better  # every step's batch and weights


def token_log_probs(model, prompt, tokens):
    """log p(token_i | prompt, tokens_<i) under ``model``, temperature 1."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def perturbed(model, scale=0.3, seed=1):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


def test_a_response_spanning_two_versions_has_each_tokens_log_prob_from_the_weights_that_sampled_it(model, tokenizer):
    """Chunk 1 is sampled with v0; v1 is loaded into the engine between chunks; the rest continue under v1. Each
    token's recorded log-prob equals the one computed independently with the weights of its own version."""
    v0, v1 = model, perturbed(model)
    engine = HFEngine(copy.deepcopy(v0), tokenizer)
    params = SamplingParams(n=1, max_new_tokens=8, temperature=1.0)
    prompts = [tokenizer.encode(t) for t in ("1+2=", "30+4=", "5+16=", "7+7=")]
    samples = [Sample(p) for p in prompts]
    torch.manual_seed(0)
    generate_chunk(engine, samples, params, chunk_tokens=3, version=0)
    assert all(s.versions == [0] * len(s.tokens) for s in samples)
    engine.load_weights(hf_weight_buckets(v1))  # what the driver does between two chunks
    while any(s.finish is None for s in samples):
        generate_chunk(engine, samples, params, chunk_tokens=3, version=1)
    spanning = [s for s in samples if s.versions[0] == 0 and s.versions[-1] == 1]
    assert spanning, [s.versions for s in samples]
    for s in samples:
        assert len(s.tokens) == len(s.log_probs) == len(s.versions) <= 8
        recorded, versions = torch.tensor(s.log_probs), torch.tensor(s.versions)
        for version, weights in ((0, v0), (1, v1)):
            mine = versions == version
            if mine.any():
                expected = token_log_probs(weights, s.prompt, s.tokens)
                assert (expected[mine] - recorded[mine]).abs().max() < 1e-4
    s = spanning[0]  # the other version's weights would give other log-probs: the check can fail
    later = torch.tensor(s.versions) == 1
    assert (token_log_probs(v0, s.prompt, s.tokens)[later] - torch.tensor(s.log_probs)[later]).abs().max() > 1e-3


@requires_vllm
def test_vllm_continues_a_response_under_new_weights_with_each_tokens_log_prob_from_its_version(
        vllm_engine, vllm_model_dir):
    """The same partial rollout on the session's real vLLM engine: chunk 1 under v0, v1 loaded through the engine's
    own weight path, the rest under v1; every token's log-prob is its version's, computed with transformers."""
    from rlflow.rollout import VLLMRollout

    policy = Policy.from_pretrained(vllm_model_dir)
    rollout = VLLMRollout(n=1, max_new_tokens=8, **ENGINE_OPTIONS)
    rollout.bind(policy.model, policy.tokenizer)
    engine, v0, v1 = rollout.engine, policy.model, perturbed(policy.model, scale=0.05)
    samples = [Sample(policy.tokenizer.encode(t)) for t in ("12+34=", "5+6=", "99+99=", "7+70=")]
    generate_chunk(engine, samples, rollout.params, chunk_tokens=3, version=0)
    rollout.sync_weights(v1)  # the engine's own weight load (the next test's bind sends its weights again)
    while any(s.finish is None for s in samples):
        generate_chunk(engine, samples, rollout.params, chunk_tokens=3, version=1)
    assert any(s.versions[0] == 0 and s.versions[-1] == 1 for s in samples)
    for s in samples:
        recorded, versions = torch.tensor(s.log_probs), torch.tensor(s.versions)
        for version, weights in ((0, v0), (1, v1)):
            mine = versions == version
            if mine.any():
                assert (token_log_probs(weights, s.prompt, s.tokens)[mine] - recorded[mine]).abs().max() < 1e-4
        later = versions == 1
        if later.any():  # v0 would not give these: the check can fail
            assert (token_log_probs(v0, s.prompt, s.tokens)[later] - recorded[later]).abs().max() > 1e-3


def make_trainer(model, tokenizer, tmp_path, rollout, steps, callbacks=(), reward=None, stages=(), lr=5e-2):
    return Trainer(policy=Policy(model, tokenizer), rollout=rollout, reward=reward or FunctionReward(longer_is_better),
                   stages=list(stages),
                   estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True), optim=Optim(lr=lr),
                   batching=Batching(batch_size=4), loop=Loop(max_steps=steps, progress=False),
                   run=RunDir(path=tmp_path, loggers=()), callbacks=list(callbacks))


def recomputed(model, tokenizer, weights, batch):
    twin = copy.deepcopy(model)
    twin.load_state_dict(weights)
    return Policy(twin, tokenizer)(batch.clone())[K.OLD_LOG_PROBS]


def test_fully_async_run_keeps_samples_within_the_threshold_and_each_token_matches_its_version(
        model, tokenizer, addition_rows, tmp_path):
    """Generation runs beside training with partial rollouts (chunks of 2 tokens): every token's rollout log-prob
    is that of the recorded weights of its own version, no trained group is older than the threshold (drop), and
    verl's trajectory metrics describe the batch."""
    recorder, steps = Recorder(), 5
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=6), max_off_policy_threshold=2,
                                max_off_policy_strategy="drop", chunk_tokens=2)
    trainer = make_trainer(model, tokenizer, tmp_path, rollout, steps, callbacks=[recorder])
    process = rollout.engine.process
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
    finally:
        rollout.close()
    assert len(history) == steps and not process.is_alive()
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        mask = batch[K.RESPONSE_MASK].bool()
        versions = batch[K.TOKEN_POLICY_VERSION]
        assert (versions[mask] >= 0).all() and (versions[~mask] == -1).all()
        oldest = torch.where(mask, versions, 10**6).min(-1).values
        assert torch.equal(oldest, batch[K.POLICY_VERSION])
        assert torch.equal(versions.max(-1).values, batch[K.POLICY_VERSION_MAX])
        assert step - 1 <= int(batch[K.POLICY_VERSION].min()) and int(versions.max()) <= step
        for version in versions[mask].unique().tolist():
            mine = mask & (versions == version)
            expected = recomputed(model, tokenizer, recorder.weights[version], batch)
            assert (expected[mine] - batch[K.ROLLOUT_LOG_PROBS][mine]).abs().max() < 1e-4
        spans = (batch[K.POLICY_VERSION_MAX] - batch[K.POLICY_VERSION] + 1).float()
        assert metrics["training/off_policy/trajectory_spans/max"] == float(spans.max())
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == float(
            (step - batch[K.POLICY_VERSION]).max()) <= 1
        assert metrics["training/off_policy/trajectory_staleness/min"] >= 0
        assert metrics["async/staleness_max"] == metrics["training/off_policy/trajectory_staleness_worst/max"]
        assert metrics["rollout_corr/rollout_is_mean"] > 0
    assert max(m["training/off_policy/trajectory_staleness_worst/max"] for m in history) == 1  # it did run ahead


def even_sums_are_constant(solution_str, ground_truth):
    """Every sample of a prompt with an even sum scores 1 (a constant group); odd sums: a score of the text that
    differs between different responses (a length would tie at the token budget). The task writes the sum's
    digits reversed: the units digit comes first."""
    return 1.0 if int(ground_truth[0]) % 2 == 0 else sum(ord(c) * (i + 1) for i, c in enumerate(solution_str)) / 1000


class Scored(FunctionReward):
    """The reward, keeping every batch it scored: (prompt texts, scores) per group, in order."""

    def __init__(self, fn):
        super().__init__(fn)
        self.groups = []

    def forward(self, batch):
        out = super().forward(batch)
        for g in out[K.GROUP].unique().tolist():
            rows = out[K.GROUP] == g
            self.groups.append((out[K.PROMPT_TEXT][int(rows.nonzero()[0])], out[K.SCORES][rows].tolist()))
        return out


def test_dynamic_sampling_replaces_each_filtered_group_by_the_next_to_finish(model, tokenizer, addition_rows, tmp_path):
    """DAPO's filter over the fully asynchronous stream: each scored group with a constant score is filtered and
    the rollout hands exactly the missing groups (``want``), so every trained group has distinct scores, every
    group scored with distinct scores is trained (none generated and then cut, as whole extra batches would be),
    no filtered prompt reaches the trainer, and ``dapo/*`` count the groups scored per step."""
    from rlflow.rollout.stream import FilterGroups

    recorder, reward, steps, B = Recorder(), Scored(even_sums_are_constant), 4, 4
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=2,
                                max_off_policy_strategy="drop", chunk_tokens=2)
    trainer = make_trainer(model, tokenizer, tmp_path, rollout, steps, callbacks=[recorder], reward=reward,
                           stages=[FilterGroups("score", max_gen_batches=8)], lr=1e-3)  # no collapse to one text
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
    finally:
        rollout.close()
    scored = iter(reward.groups)
    for batch, metrics in zip(recorder.batches, history, strict=True):
        texts = list(batch[K.PROMPT_TEXT][::2])
        assert batch[K.GROUP].tolist() == [g for g in range(B) for _ in range(2)]
        assert all(batch[K.SCORES][2 * i] != batch[K.SCORES][2 * i + 1] for i in range(B))  # non-zero variance
        kept, step = [], []  # this step's scored groups, in order, until B have distinct scores
        while len(kept) < B:
            text, scores = next(scored)
            step.append(text)
            if len(set(scores)) > 1:
                kept.append(text)
        assert texts == kept  # the kept ones, all of them, in order: no filtered group, no kept group cut
        assert metrics["dapo/num_gen_batches"] == len(step) / B
        assert metrics["dapo/kept_group_frac"] == B / len(step)
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] <= 1  # threshold 2, drop
    filtered = sum(len(set(s)) == 1 for _, s in reward.groups)
    assert filtered > 0 and any(m["dapo/num_gen_batches"] > 1 for m in history)  # it did filter


def test_dynamic_sampling_over_the_stream_stops_at_max_gen_batches_worth_of_groups(model, tokenizer, addition_rows):
    """Every group constant: after max_gen_batches x P groups scored for one step, the run stops naming the counts
    (verl's max_num_gen_batches: the groups that many synchronous rounds generate)."""
    from rlflow.rollout.stream import Experience, FilterGroups

    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=2), max_off_policy_threshold=2, chunk_tokens=2)
    rollout.bind(model, tokenizer)
    reward = Scored(lambda solution_str, ground_truth: 1.0)
    stream = Experience(rollout, reward, [FilterGroups("score", max_gen_batches=2)])(
        PromptData(addition_rows[0], seed=0).loader(4, tokenizer))
    try:
        with pytest.raises(RuntimeError, match=r"8 groups scored for one step \(2 batches' worth, max_gen_batches\) "
                                               r"gave only 0 prompt groups"):
            next(stream)
    finally:
        stream.close()
        rollout.close()
    assert len(reward.groups) == 8  # the first batch, then top-ups of the missing groups up to the budget


@pytest.mark.parametrize("strategy", ["wait"])
def test_threshold_one_trains_every_token_on_the_weights_that_sampled_it(model, tokenizer, addition_rows, tmp_path,
                                                                         strategy):
    """Threshold 1: nothing is admitted while the trainer learns, so every token of batch t comes from version t."""
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=1,
                                max_off_policy_strategy=strategy, chunk_tokens=2)
    recorder = Recorder()
    trainer = make_trainer(model, tokenizer, tmp_path, rollout, 3, callbacks=[recorder])
    try:
        history = trainer.fit(PromptData(addition_rows[0], seed=0))
    finally:
        rollout.close()
    for step, (batch, metrics) in enumerate(zip(recorder.batches, history)):
        mask = batch[K.RESPONSE_MASK].bool()
        assert (batch[K.TOKEN_POLICY_VERSION][mask] == step).all()
        assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 0
        assert metrics["training/off_policy/trajectory_spans/max"] == 1 and metrics["async/dropped_groups"] == 0


def test_a_finished_group_over_the_threshold_is_dropped_and_replaced_by_the_next_prompt(model, tokenizer, addition_rows):
    """Threshold 1, drop: groups admitted at version 1 that are trained at version 2 (two pushes for one batch)
    are 2 versions old: they are evicted, counted, and the next prompts, admitted under version 2, take their
    place (in the order they were drawn)."""
    import time

    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=1,
                                max_off_policy_strategy="drop", chunk_tokens=1)
    rollout.bind(model, tokenizer)
    loader, drawn = PromptData(addition_rows[0], seed=0).loader(4, tokenizer), []

    def prompts():
        while True:
            drawn.append(next(loader))
            yield drawn[-1]

    def push():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        rollout.sync_weights(model)

    stream = rollout.stream(prompts())
    try:
        first = next(stream)
        assert (first[K.TOKEN_POLICY_VERSION][first[K.RESPONSE_MASK].bool()] == 0).all()
        push()
        deadline = time.monotonic() + 60  # the driver admits the next 4 groups under version 1
        while sum(g.admitted == 1 for g in rollout._active + rollout._ready) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        push()
        second = next(stream)
    finally:
        stream.close()
        rollout.close()
    assert rollout.stats["async/dropped_groups"] == 4 and rollout.stats["async/staleness_max"] == 0
    assert (second[K.TOKEN_POLICY_VERSION][second[K.RESPONSE_MASK].bool()] == 2).all()
    texts = [t for b in drawn for t in b[K.PROMPT_TEXT]]
    assert list(second[K.PROMPT_TEXT][::2]) == texts[8:12]  # prompts 4..7 were dropped; 8..11 replaced them


def test_a_stream_read_without_weight_pushes_keeps_going_at_threshold_one(model, tokenizer, addition_rows):
    """Outside a Trainer nothing pushes weights: a batch asked for again is trained on the same version, so
    admission opens for it (it would wait for the timeout otherwise)."""
    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=2), max_off_policy_threshold=1, timeout=30)
    rollout.bind(model, tokenizer)
    stream = rollout.stream(PromptData(addition_rows[0], seed=0).loader(4, tokenizer))
    try:
        batches = [next(stream) for _ in range(3)]
    finally:
        stream.close()
        rollout.close()
    assert all(b[K.POLICY_VERSION].tolist() == [0] * 8 for b in batches)


def test_a_dead_generation_process_fails_the_run_naming_it(model, tokenizer, addition_rows):
    """The engine's process is killed: the next batch raises with the process and the signal, it does not hang
    (no restart: it would be forked from the driver thread, which can deadlock in the child)."""
    import os
    import signal

    from rlflow.rollout.engines.process import EngineProcessError

    rollout = FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=2, chunk_tokens=1)
    rollout.bind(model, tokenizer)
    stream = rollout.stream(PromptData(addition_rows[0], seed=0).loader(4, tokenizer))
    try:
        next(stream)
        os.kill(rollout.engine.process.pid, signal.SIGKILL)
        rollout.sync_weights(model)
        with pytest.raises(EngineProcessError, match=r"generation process \(pid \d+\) was killed by SIGKILL"):
            for _ in range(10):
                next(stream)
                rollout.sync_weights(model)
    finally:
        stream.close()
        rollout.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_off_policy_threshold": 0}, "max_off_policy_threshold"),
    ({"max_off_policy_strategy": "skip"}, "max_off_policy_strategy"),
    ({"num_warmup_batches": -1}, "num_warmup_batches"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"placement": "gpu"}, "placement"),
    ({"pause_mode": "abort"}, "pause_mode"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FullyAsyncRollout(HFRollout(n=2), **kwargs)


def trains_every_drawn_prompt_once(tmp_path, rollout, policy, data, key, steps=5, batch_size=4):
    """Runs a Trainer over ``rollout()`` (n=2) and ``policy()`` in a forked child, SIGKILLed in step 3's update (its
    batch taken, the checkpoint of step 2 on disk), then again with ``resume="auto"``; checks, with each prompt
    named by its ``key`` column, that over the run's lineage (each step as last trained) no prompt is trained twice,
    and trained + still outstanding at the end = exactly the first prompts the loader drew, none lost."""
    log, left = tmp_path / "trained.jsonl", tmp_path / "outstanding.json"

    class Log:
        def on_rollout_end(self, trainer, batch):
            with open(log, "a") as f:
                prompts = [json.dumps(p) for p in batch[key][::2]]
                f.write(json.dumps({"step": trainer.global_step + 1, "prompts": prompts}) + "\n")

    def child(kill):
        if kill:
            real, calls = Trainer.update_actor, [0]

            def update_actor(self, batch):
                calls[0] += 1
                if calls[0] == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(self, batch)

            Trainer.update_actor = update_actor
        wrapped = rollout()
        trainer = Trainer(policy=policy(), rollout=wrapped, reward=FunctionReward(longer_is_better),
                          estimator=Chain(TruncatedIS(), GRPO()), loss=PPOLoss(is_weights=True), optim=Optim(lr=5e-2),
                          batching=Batching(batch_size=batch_size), loop=Loop(max_steps=steps, progress=False),
                          callbacks=[Log()], run=RunDir(path=tmp_path / "run", loggers=(), save_every=1, resume="auto"))
        try:
            trainer.fit(data)
            left.write_text(json.dumps([json.dumps(p["values"][key]) for p in wrapped.state_dict()["prompts"]]))
        finally:
            wrapped.close()

    ctx = multiprocessing.get_context("fork")
    for kill in (True, False):
        proc = ctx.Process(target=child, args=(kill,))
        proc.start()
        proc.join(timeout=300)
        assert proc.exitcode == (-signal.SIGKILL if kill else 0)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # step 3 was taken, killed, and trained after resume
    assert [r["step"] for r in records] == [1, 2, 3, *range(3, steps + 1)]
    lineage = {r["step"]: r["prompts"] for r in records}  # each step as it was last trained
    trained = [p for step in sorted(lineage) for p in lineage[step]]
    assert len(trained) == len(set(trained)) == steps * batch_size  # none trained twice
    outstanding = json.loads(left.read_text())
    drawn = len(trained) + len(outstanding)
    assert drawn % batch_size == 0 and not set(trained) & set(outstanding)
    loader = data.loader(batch_size, policy().tokenizer)
    order = [json.dumps(p) for _ in range(drawn // batch_size) for p in next(loader)[key]]
    assert sorted(trained + outstanding) == sorted(order)  # none lost


def test_a_run_killed_mid_step_and_resumed_trains_every_drawn_prompt_once(model, tokenizer, addition_rows, tmp_path):
    """SIGKILL mid-step and resume: the prompts drawn but not trained at the checkpoint (queued, in flight or
    complete) are saved with it and generated again, the loader resumes after the last prompt drawn."""
    trains_every_drawn_prompt_once(
        tmp_path, lambda: FullyAsyncRollout(HFRollout(n=2, max_new_tokens=4), max_off_policy_threshold=2,
                                            max_off_policy_strategy="wait", chunk_tokens=2),
        lambda: Policy(copy.deepcopy(model), tokenizer), PromptData(addition_rows[0], seed=0), K.PROMPT_TEXT)
