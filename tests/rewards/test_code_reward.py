"""CodeReward: responses' code runs against test cases in the sandbox; misbehaving programs cost their
own sample's score and are counted; identical programs run once per call."""

import json

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlflow.data import keys as K
from rlflow.rewards import RewardWarning, default_compute_score
from rlflow.rewards.code import CodeReward, extract_code, parse_tests
from rlflow.sandbox import Limits, Sandbox

STDIO = json.dumps({"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6"]})
CALL = {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]}
FAST = Sandbox(Limits(wall_s=3, cpu_s=1, memory_mb=256, max_processes=4, max_output_bytes=4096))
MISSING = [layer for layer in FAST.require if layer not in FAST.isolation()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this kernel lacks the sandbox's required layers {MISSING}")


def batch_of(responses, truths):
    b = len(responses)
    return TensorDict({
        K.RESPONSE_TEXT: NonTensorStack(*responses), K.RESPONSE_MASK: torch.ones(b, 2, dtype=torch.long),
        K.GROUND_TRUTH: NonTensorStack(*truths), K.DATA_SOURCE: NonTensorStack(*["codecontests"] * b),
        K.EXTRA_INFO: NonTensorStack(*[None] * b),
    }, batch_size=[b])


def fenced(code, lang="python"):
    return f"Here is my answer.\n```{lang}\n{code}\n```\nDone."


GOOD = fenced("a, b = map(int, input().split())\nprint(a + b)")
HALF = fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)")


def test_extract_code_and_parse_tests():
    assert extract_code("```js\nx\n```\n```python\ny = 1\n```") == "y = 1\n"
    assert extract_code("```\nz\n```") == "z\n" and extract_code("print(1)") == "print(1)"
    assert [c["kind"] for c in parse_tests(STDIO)] == ["stdio", "stdio"]
    assert parse_tests(CALL)[1] == {"kind": "call", "name": "add", "args": [5, 5], "expected": 10}
    assert parse_tests(["assert f() == 1"]) == [{"kind": "assert", "code": "assert f() == 1"}]
    with pytest.raises(ValueError, match="inputs"):
        parse_tests({"inputs": [1], "outputs": []})


def test_pass_rates_and_misbehaving_programs_cost_only_their_sample():
    reward = CodeReward(FAST, workers=4)
    responses = [GOOD, HALF, fenced("while True: pass"), fenced("import os\nwhile True: os.fork()"),
                 fenced("x = ' ' * (2 ** 31)"), fenced("print(open('/etc/shadow').read())"), GOOD]
    with pytest.warns(RewardWarning, match="unreadable test cases"):
        out = reward(batch_of(responses + ["no tests"], [STDIO] * 7 + ["not json"]))
    assert out[K.SCORES].tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert reward.extras["passed"][:2] == [2, 1] and reward.extras["total"][0] == 2
    stats = reward.stats
    assert stats["reward/code/cached"] == 1  # the second GOOD ran from the cache
    assert stats["reward/code/cases"] == 12  # 6 distinct programs x 2 cases
    # per case: the loop hits its CPU limit (its wall limit on a busy machine), the allocation its memory limit;
    # the fork loop dies when fork fails, reading /etc/shadow is refused (errors); HALF answers one case wrong
    assert stats.get("reward/code/cpu_limit", 0) + stats.get("reward/code/timeout", 0) == 2
    assert stats["reward/code/memory_limit"] == 2
    assert stats["reward/code/wrong"] == 1 and stats["reward/code/error"] == 4
    assert stats["reward/errors"] == 1


def test_call_based_and_assert_tests_and_all_or_nothing():
    add = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("class Solution:\n    def add(self, a, b):\n        return a * 2")
    asserts = {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    out = CodeReward(FAST)(batch_of([add, wrong, add], [CALL, CALL, asserts]))
    assert out[K.SCORES].tolist() == [1.0, 0.5, 0.5]
    strict = CodeReward(FAST, all_or_nothing=True)
    assert strict(batch_of([add, wrong], [CALL, CALL]))[K.SCORES].tolist() == [1.0, 0.0]


def test_verl_code_sources_dispatch_to_the_sandbox():
    assert default_compute_score("codecontests", GOOD, STDIO) == {"score": 1.0, "passed": 2, "total": 2}
    assert default_compute_score("apps", HALF, STDIO)["score"] == 0.5
