"""verl's per-row ``agent_name`` through the verl entry point: each row runs the loop it names (the file's loops,
``tool_agent``, ``single_turn_agent``), rows without one the default; an unknown name fails naming the row."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.config import load_config, make_plan
from rlflow.config.verl.build import build_trainer
from rlflow.data import keys as K
from rlflow.trainer.main_ppo import main
from tests.config.test_main_ppo import steps
from tests.config.test_multi_turn_keys import AGENT, chat_model_dir, example, gsm8k_tool_data, no_gpus  # noqa: F401

TAGGED = '''
from rlflow.rollout.agent import AgentLoop


class Tagged(AgentLoop):
    """One model turn, then a user turn saying [tag]: the mark that this loop ran."""

    def __init__(self, rollout, tag, **kwargs):
        super().__init__(rollout, **kwargs)
        self.tag = tag

    async def run_one(self, t, sampler):
        try:
            out = await sampler.generate(t.context, min(4, t.remaining))
            t.add_model_turn(out.token_ids, out.log_probs, out.extras.get("token_versions"))
            last = out.token_ids[-1] if out.token_ids else None
            if t.add_observation(self.chat.append_ids([{"role": "user", "content": f"[{self.tag}]"}], last)):
                t.user_turns += 1
            t.finish = "answer"
        finally:
            sampler.retire()
'''
NAMES = ["alpha", "beta", None, "single_turn_agent"]  # one per training row, in the file's order


@pytest.fixture
def named(example, tmp_path):
    """The GSM8K example with two tagging loops in a loops file and rows that name them."""
    (tmp_path / "tagged.py").write_text(TAGGED)
    (tmp_path / "loops.yaml").write_text("".join(f"- name: {tag}\n  _target_: {tmp_path}/tagged.py:Tagged\n  tag: {tag}\n"
                                                 for tag in ("alpha", "beta")))
    data = Path(example[5].split("=", 1)[1]).parent
    for split in ("train", "test"):
        table = pq.read_table(data / f"{split}.parquet")
        pq.write_table(table.append_column("agent_name", pa.array(NAMES, pa.string())), tmp_path / f"{split}.parquet")
    return [a if not a.startswith(("data.train_files", "data.val_files")) else
            f"{a.split('=')[0]}={tmp_path}/{'train' if 'train' in a else 'test'}.parquet" for a in example] + [
        f"{AGENT}.agent_loop_config_path={tmp_path}/loops.yaml", "data.max_response_length=96"]  # room for the tag


def test_each_row_runs_the_loop_it_names_in_its_order(named, capsys):
    trainer, data = build_trainer(make_plan(load_config(named[4:], config_file=Path(named[1]) / "gsm8k_multiturn_grpo.yaml")))
    rows = data.collate(data.train, trainer.rollout.tokenizer)
    assert rows[K.AGENT_NAME] == NAMES
    out = trainer.rollout(rows)
    texts, questions, n = out[K.RESPONSE_TEXT], [r["prompt"][-1]["content"] for r in data.train], 2
    assert out[K.GROUP].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for i, name in enumerate(NAMES):
        for sample in range(i * n, (i + 1) * n):
            prompt = out[K.PROMPT_TEXT][sample]  # the row's own prompt, in the batch's order (the tiny vocabulary
            assert questions[i].replace(" ", "") in prompt  # has no spaces)
            assert ("[alpha]" in texts[sample], "[beta]" in texts[sample]) == (name == "alpha", name == "beta")
            # the file's loops and the default get the multi-turn keys (the example's tools); single_turn_agent none
            assert ("tools:calculator(expression)" in prompt) == (name != "single_turn_agent")
            if name is not None:  # a model turn and the tag; one model turn
                assert int(out[K.NUM_TURNS][sample]) == (3 if name != "single_turn_agent" else 2)
    assert main(named) == 0  # and it trains
    assert steps(capsys.readouterr().out)[1]["num_turns/max"] >= 3


def test_the_dry_run_shows_the_named_loops(named, capsys):
    assert main(named + ["--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "name='tool_agent', agents={'alpha': functools.partial(" in out and "tag='alpha'" in out
    assert "'single_turn_agent': functools.partial(AgentLoop" in out


def test_an_unknown_agent_name_names_the_file_the_row_and_the_loops(named, tmp_path, capsys):
    table = pq.read_table(tmp_path / "test.parquet")
    table = table.set_column(table.column_names.index("agent_name"), "agent_name",
                             pa.array(["alpha", None, "react_agent", None], pa.string()))
    pq.write_table(table, tmp_path / "test.parquet")
    assert main(named + ["--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (f"data.train_files / data.val_files: {tmp_path}/test.parquet, row 2: agent_name='react_agent' is not an "
            "agent loop of this run (known: alpha, beta, single_turn_agent, tool_agent") in err


def test_a_single_turn_run_refuses_rows_naming_other_loops(named, capsys):
    single = ["actor_rollout_ref.rollout.multi_turn.enable=false", "actor_rollout_ref.rollout.multi_turn.tool_config_path=null"]
    assert main(named + single + ["--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "row 0: agent_name='alpha' is not an agent loop of this run (known: single_turn_agent" in err
    assert "set actor_rollout_ref.rollout.multi_turn.enable=True for rows to run other agent loops" in err
