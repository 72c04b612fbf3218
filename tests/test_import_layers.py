"""``rlflow`` imports stay at the top of a module, so that what a module imports is what its layer says.

An import inside a function hides an edge of the import graph (and the circles it closes: issue 26 had four,
held together this way). One reason is good: deferring a third-party package (torch, transformers, vLLM, PEFT,
megatron-core, Lightning, ...) so that the CLI, config checks and ``import rlflow`` stay fast. ``ALLOWED`` lists
every ``rlflow`` import still inside a function, with its reason; a new one fails here, and an entry whose import
is gone must leave the list, so the list can only shrink. A "defers ..." reason is checked: importing the module
loads each package named, and the importing module does not load it already. The layers themselves are the
import-linter contract in ``pyproject.toml`` (``lint-imports``, run by ``.ci/run``); it sees only imports that point
up a layer, so two modules of one package that import each other are caught here: no module is on an import circle
(imports inside functions count: they tie the modules together all the same).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph)


# (importing module, imported module) without the "rlflow." prefix -> why the import sits inside a function.
# Every entry defers a third-party package, for one of four reasons: the CLI and the config checks report every
# problem before torch loads (cli, config.*); `rlflow export` / checkpoint paths are checked before torch loads
# (trainer.training_state); PEFT loads only for a LoRA model (models.*); Lightning and transformers only where a
# strategy or a model is really built (rewards.model, strategies.megatron, tasks.shapes).
ALLOWED = {
    ("cli", "config.verl.run"): "defers omegaconf, yaml",  # rlflow --help and the default job start 0.6 s sooner
    ("cli", "config.components"): "defers hydra, omegaconf, yaml",  # as config.run: only a config needs them
    ("cli", "tasks.prepare"): "defers tensordict, tokenizers, torch, transformers",
    ("cli", "rewards.sandbox_server"): "defers tensordict, torch",  # rlflow sandbox serve
    ("config.verl.agent", "rollout.tools.config"): "defers tensordict, torch, transformers",
    ("config.verl.agent", "rollout.tools.functions"): "defers tensordict, torch, transformers",
    ("config.verl.asynchronous", "algorithms"): "defers tensordict, torch",
    ("config.verl.data_keys", "rollout.tools.config"): "defers tensordict, torch, transformers",
    ("config.verl.reward_fn", "rewards"): "defers tensordict, torch, transformers",
    ("config.verl.reward_fn", "rewards.dispatch"): "defers tensordict, torch, transformers",
    ("config.verl.reward_fn", "rewards.geo3k"): "defers tensordict, torch, transformers",
    ("config.verl.run", "config.verl.build"): "defers lightning_fabric, tensordict, torch, transformers",
    ("config.verl.run", "config.verl.dryrun"): "defers lightning_fabric, tensordict, torch, transformers",
    ("config.verl.run", "config.verl.plan"): "defers tensordict, torch, transformers",
    ("config.verl.trainer_extras", "trainer.generations"): "defers tensordict, torch",
    ("config.verl.megatron", "strategies.megatron"): "defers lightning_fabric, torch",
    ("config.verl.megatron", "strategies.megatron.memory"): "defers lightning_fabric, torch",
    ("config.verl.megatron", "strategies.megatron.model"): "defers lightning_fabric, torch",
    ("config.verl.megatron", "strategies.megatron.lora"): "defers lightning_fabric, torch",
    ("config.verl.megatron", "strategies.megatron.vision"): "defers lightning_fabric, torch",
    ("models.policy", "models.lora"): "defers peft",
    ("models.critic", "models.lora"): "defers peft",
    ("rewards.model", "strategies"): "defers lightning_fabric",
    ("strategies.megatron.strategy", "models.critic"): "defers tensordict, transformers",
    ("strategies.megatron.strategy", "models.logprobs"): "defers transformers",
    ("tasks.shapes", "models.policy"): "defers transformers",
    ("tasks.shapes", "models.tiny_vlm"): "defers tokenizers, transformers",
    ("trainer.training_state", "models.policy"): "defers tensordict, torch, transformers",
    ("trainer.training_state", "strategies"): "defers lightning_fabric, torch",
}


def _key(module: str) -> str:
    return module.removeprefix("rlflow.")


def _inside() -> dict[tuple[str, str], list[str]]:
    """Every rlflow import inside a function: (importer, imported) -> ["path:line", ...]."""
    known = graph.modules()
    found: dict[tuple[str, str], list[str]] = {}
    for name, path in known.items():
        for imported, line, in_function in graph.imports(name, path, known):
            if in_function:
                found.setdefault((_key(name), _key(imported)), []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def _loads() -> dict[str, set[str]]:
    """Module -> the third-party packages importing it loads (its own top-level imports, its packages' __init__
    and, transitively, the rlflow modules those import at the top)."""
    known = graph.modules()
    top = {n: {m for m, _, inside in graph.imports(n, p, known) if not inside} for n, p in known.items()}
    own = {n: graph.third_party(p) for n, p in known.items()}

    def with_parents(module: str) -> list[str]:
        parts = module.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]

    def loads(module: str) -> set[str]:
        seen, stack, out = set(), with_parents(module), set()
        while stack:
            m = stack.pop()
            if m in seen or m not in known:
                continue
            seen.add(m)
            out |= own[m]
            for t in top[m]:
                stack += with_parents(t)
        return out

    return {n: loads(n) for n in known}


def test_rlflow_imports_inside_functions_are_only_the_listed_ones():
    found = _inside()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    gone = sorted(k for k in ALLOWED if k not in found)
    assert not new, ("rlflow imports inside functions (import at the top; deferring a third-party package is the only "
                     "reason to list one in ALLOWED): " + "; ".join(f"{a} -> {b} at {', '.join(w)}" for (a, b), w in
                                                                 sorted(new.items())))
    assert not gone, f"no longer inside a function, delete from ALLOWED: {gone}"


def test_no_module_is_on_an_import_circle():
    edges, _ = graph.graph()
    found = graph.circles(edges)
    assert not found, ("import circles (cut each: move the shared piece to a module both import, pass it in, or move "
                       "the code to the module that owns it): " + "; ".join(" <-> ".join(c) for c in found))


def test_a_deferral_defers_what_it_says():
    loads = _loads()
    wrong = []
    for (importer, imported), reason in ALLOWED.items():
        if reason.startswith("defers "):
            named = {p.strip() for p in reason.removeprefix("defers ").split(",")}
            deferred = loads[f"rlflow.{imported}"] - loads[f"rlflow.{importer}"]
            if not named <= deferred:
                shown = sorted(deferred - set(sys.stdlib_module_names))
                wrong.append(f"{importer} -> {imported}: says {sorted(named)}, defers {shown}")
    assert not wrong, wrong


@pytest.mark.parametrize("old, new, name", [
    ("rlflow.tasks.export", "rlflow.tasks.prepare", "export_task"),
    ("rlflow.strategies.megatron.export", "rlflow.strategies.megatron.weight_buckets", "WeightExporter"),
    ("rlflow.strategies.megatron.checkpoint", "rlflow.strategies.megatron.sharded_checkpoint", "ShardedCheckpoint"),
    ("rlflow.trainer.checkpoint", "rlflow.trainer.training_state", "resume"),
    ("rlflow.trainer.export", "rlflow.trainer.hf_export", "export_hf"),
    ("rlflow.rollout.engines.checkpoint", "rlflow.rollout.engines.weights_on_disk", "write_checkpoint"),
])
def test_a_renamed_module_keeps_its_old_path_with_a_warning(old, new, name):
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.reload(importlib.import_module(old))  # reload: the warning again if already imported
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
