"""verl's data, reference and rollout keys rlflow used to refuse, through the verl entry point:
``data.reward_fn_key`` (the data-source column), ``data.custom_cls`` (a user's dataset class), ``data.sampler``
(a user's curriculum sampler, updated after every step), ``ref.model`` (the reference's own weights),
``rollout.over_sample_rate`` (a note) and ``rollout.ignore_eos``. Each is shown to change what is built or
trained, and a bad one named."""

import pandas as pd
import pytest

import rlflow.config.verl.devices as devices
from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_data, load_tokenizer
from rlflow.config.verl.loading import ConfigError
from rlflow.config.verl.run import unused_notes
from rlflow.registry import load_object
from rlflow.trainer.main_ppo import main
from tests.config.conftest import verl_rows

DATASET = '''
import pandas as pd
import torch
from torch.utils.data import Dataset


class ReversedQuestions(Dataset):
    """verl's contract: made with data_files, tokenizer, processor, config, max_samples; items are dicts."""

    def __init__(self, data_files, tokenizer, processor, config, max_samples=-1):
        self.rows = pd.concat([pd.read_parquet(f) for f in data_files]).to_dict("records")
        self.prompt_key, self.made_with = config.prompt_key, (tokenizer is not None, max_samples)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = dict(self.rows[i])
        messages = [dict(m) for m in row.pop(self.prompt_key)]
        messages[-1]["content"] = messages[-1]["content"][::-1]
        return {**row, "raw_prompt": messages, "input_ids": torch.zeros(3, dtype=torch.long)}


class NotADataset:
    def __init__(self, **kwargs):
        pass
'''

SAMPLER = '''
from torch.utils.data import Sampler

UPDATES = []


class Backwards(Sampler):
    """verl's AbstractCurriculumSampler contract: made with data_source and data_config; update(batch)."""

    def __init__(self, data_source, data_config):
        self.n, self.seen = len(data_source), set()

    def __iter__(self):  # the last rows first; rows of a batch it was told about go to the back
        order = [i for i in reversed(range(self.n)) if i not in self.seen]
        return iter(order + sorted(self.seen))

    def __len__(self):
        return self.n

    def update(self, batch):
        rows = sorted(set(batch["row_index"].tolist()))
        self.seen |= set(rows)
        UPDATES.append((rows, batch["scores"].shape[0]))
'''


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(devices, "cuda_count", lambda: 0)


def rows_of(overrides):
    plan = make_plan(load_config(overrides))
    return plan, build_data(plan, load_tokenizer(plan))


def test_reward_fn_key_names_the_data_source_column(tiny, tmp_path):
    rows = [dict(r, data_source="scraped-2024", task="openai/gsm8k") for r in verl_rows(8, "train", 0)]
    pd.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    files = [f"data.train_files={tmp_path}/t.parquet", f"data.val_files={tmp_path}/t.parquet"]
    with pytest.raises(ConfigError, match="scraped-2024"):  # the data_source column: no built-in reward for it
        rows_of(tiny + files)
    plan, data = rows_of(tiny + files + ["data.reward_fn_key=task"])
    assert {r["data_source"] for r in data.train + data.val} == {"openai/gsm8k"}  # the gsm8k scorer scores them
    assert any("data.reward_fn_key=task" in n for n in plan.notes)
    with pytest.raises(ConfigError, match="row 0: no 'topic' column"):
        rows_of(tiny + files + ["data.reward_fn_key=topic"])


def test_custom_dataset_class_gives_the_rows(tiny, tmp_path, data_dir):
    (tmp_path / "my_dataset.py").write_text(DATASET)
    cls = [f"data.custom_cls.path={tmp_path}/my_dataset.py", "data.custom_cls.name=ReversedQuestions"]
    _, plain = rows_of(tiny)
    plan, data = rows_of(tiny + cls)
    assert [r["prompt"][-1]["content"] for r in data.train] == [r["prompt"][-1]["content"][::-1] for r in plain.train]
    assert [r["ground_truth"] for r in data.val] == [r["ground_truth"] for r in plain.val]
    assert any("data.custom_cls" in n and "tensors the items carry are not used" in n for n in plan.notes)
    assert not [n for n in unused_notes(plan.cfg) if "custom_cls" in n]
    with pytest.raises(ConfigError, match="must subclass torch.utils.data.Dataset"):
        make_plan(load_config(tiny + [cls[0], "data.custom_cls.name=NotADataset"]))
    with pytest.raises(ConfigError, match="defines no 'Missing'"):
        make_plan(load_config(tiny + [cls[0], "data.custom_cls.name=Missing"]))
    with pytest.raises(ConfigError, match="needs data.custom_cls.name"):
        make_plan(load_config(tiny + [cls[0]]))
    assert main(tiny + cls + ["--dry-run"]) == 0


def test_curriculum_sampler_orders_the_prompts_and_learns_each_step(tiny, tmp_path, capsys):
    (tmp_path / "my_sampler.py").write_text(SAMPLER)
    sampler = [f"data.sampler.class_path={tmp_path}/my_sampler.py", "data.sampler.class_name=Backwards"]
    updates = load_object(str(tmp_path / "my_sampler.py"), "UPDATES", "test")
    assert main(tiny + sampler + ["trainer.val_before_train=false", "trainer.test_freq=-1"]) == 0
    # 12 training rows, 4 prompts x n=2 a step: the last four rows, then the four before them (the sampler's order;
    # data.shuffle would draw others), each step's whole batch handed to update() with its scores
    assert updates == [([8, 9, 10, 11], 8), ([4, 5, 6, 7], 8)]
    with pytest.raises(ConfigError, match="data.sampler.class_path=.*defines no 'Nope'"):
        make_plan(load_config(tiny + [sampler[0], "data.sampler.class_name=Nope"]))


def test_ref_model_is_the_reference_instead_of_a_policy_copy(tiny, tmp_path, model_dir):
    import torch

    from rlflow.config.verl.build import build_trainer, run_notes
    from rlflow.models.tiny import char_tokenizer, tiny_qwen2

    other = tmp_path / "ref-model"
    tiny_qwen2(len(char_tokenizer()), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
               intermediate_size=64, seed=7).save_pretrained(other)
    kl = tiny + ["actor_rollout_ref.actor.use_kl_loss=true"]

    def weights(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    plain, _ = build_trainer(make_plan(load_config(kl)))
    assert torch.equal(weights(plain.reference.model), weights(plain.policy.model))  # a copy of the policy
    plan = make_plan(load_config(kl + [f"actor_rollout_ref.ref.model={other}"]))
    trainer, data = build_trainer(plan)
    assert not torch.equal(weights(trainer.reference.model), weights(trainer.policy.model))
    assert trainer.reference.log_prob_key == "ref_log_probs" and not trainer.reference.model.training
    assert not any(p.requires_grad for p in trainer.reference.model.parameters())
    assert any("actor_rollout_ref.ref.model=" in n for n in plan.notes)
    assert not any("nothing in this run reads" in n for n in run_notes(plan, data, trainer))
    unread = make_plan(load_config(tiny + [f"actor_rollout_ref.ref.model={other}"]))  # no KL: nothing reads it
    trainer, data = build_trainer(unread)
    assert trainer.reference is None
    assert any(n.startswith(f"actor_rollout_ref.ref.model={other} has no effect: nothing in this run reads")
               for n in run_notes(unread, data, trainer))
    small = tmp_path / "small-vocab"
    tiny_qwen2(8, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               seed=7).save_pretrained(small)
    with pytest.raises(ConfigError, match="its vocabulary has 8 tokens"):
        build_trainer(make_plan(load_config(kl + [f"actor_rollout_ref.ref.model={small}"])))


def test_over_sample_rate_is_accepted_with_a_note_as_verl_never_reads_it(tiny):
    plan = make_plan(load_config(tiny + ["actor_rollout_ref.rollout.over_sample_rate=0.1"]))
    assert any("over_sample_rate=0.1 has no effect" in n and "no code of verl reads it" in n
               for n in unused_notes(plan.cfg))


def test_ignore_eos_reaches_the_hf_rollout_and_names_the_engines_that_cannot(tiny):
    from rlflow.config.errors import NotSupportedError
    from rlflow.config.verl.resolve import instantiate

    plan = make_plan(load_config(tiny + ["actor_rollout_ref.rollout.ignore_eos=true"]))
    rollout = instantiate(plan.rollout_cls, plan.rollout_kwargs, "actor_rollout_ref.rollout.*")  # as build_trainer
    assert type(rollout).__name__ == "HFRollout" and rollout.params.ignore_eos  # tests/rollout: what it does
    server = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.server.url=http://127.0.0.1:1"]
    with pytest.raises(NotSupportedError, match="generation past EOS with ServerRollout"):  # no vLLM needed here
        make_plan(load_config(tiny + ["actor_rollout_ref.rollout.ignore_eos=true", *server]))
