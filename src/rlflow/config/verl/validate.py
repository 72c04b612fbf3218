"""Check a whole verl config before anything heavy loads, and report every problem in one message.

:func:`validate` runs, on the loaded config (keys and types already checked by
:func:`~rlflow.config.verl.loading.load_config`):

1. the tables of :mod:`rlflow.config.verl.checks`: features not supported yet, numeric ranges, choices,
   registry names (``grpo`` or ``my_est.py:MedianGRPO``);
2. rules between keys (``CROSS_CHECKS``): batch units, per-GPU vs deprecated sizes, loggers,
   sequence parallelism, DAPO's overlong buffer, ...;
3. devices: the processes asked for against this machine;
4. with ``environment=True`` (the command line does this; :mod:`rlflow.config.verl.validate_files`): files exist,
   model folders look like models (``config.json``, weights, tokenizer), ``max_prompt_length +
   max_response_length`` fits the model's ``max_position_embeddings`` (read from ``config.json``, no weights), a
   model for ``rollout.enable_vision`` has a vision config, data files have the prompt column and enough rows for
   one batch.

The checks share a :class:`~rlflow.config.verl.validate_context.Context`.

Reading keys here does not count as "used" (the unused-key notes come from building the plan).
Nothing here imports torch, transformers or Lightning.
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any, Callable

from rlflow.config.verl import checks, tables
from rlflow.config.verl import devices as verl_devices
from rlflow.config.verl.devices import resolve_devices
from rlflow.config.verl.distillation import loss_problems as distillation_loss_problems
from rlflow.config.verl.reward_class import class_from_file
from rlflow.config.verl.reward_section import user_names
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig, raise_problems
from rlflow.config.verl.role_keys import sequence_parallel_keys
from rlflow.config.verl.validate_context import Context, positive_int
from rlflow.config.verl.validate_files import check_environment
from rlflow.config.verl.validate_files import (DATA_SUFFIXES, POSITION_KEYS, check_data_files, check_model,  # noqa: F401
                                               check_position_embeddings, check_reward_files, check_vision_model,
                                               parquet_rows)  # (importable from here, as before they moved)
from rlflow.registry import module_defines

A, R, C = checks.A, checks.R, checks.C


# ---------------------------------------------------------------------------------------------- tables

def check_not_supported(ctx: Context) -> None:
    hits: dict[str, list[tuple[str, Any]]] = {}  # feature -> the keys that ask for it (one message each)
    for key, feature, triggered in tables.not_supported(ctx.cfg.flat):
        value = ctx.get(key)
        try:
            hit = ctx.ok(key) and triggered(value)
        except TypeError:
            continue
        if hit:
            if feature == tables.OTHER_BACKENDS:  # name the backend the value selects
                feature = tables.other_backend(value)
            hits.setdefault(feature, []).append((key, value))
    for feature, keys in hits.items():
        if len(keys) == 1:
            ctx.add(NotSupportedError(*keys[0], feature))
        else:  # e.g. a script's ten settings of an engine rlflow does not have: one message names them all
            error = NotSupportedError(*keys[0], feature)
            error.args = (f"{', '.join(f'{k}={v!r}' for k, v in keys)}: {feature} is not supported yet in rlflow.",)
            ctx.add(error)
    # profiling (global_profiler.tool, *.profiler.enable) changes no result: a note says it is not supported yet


def check_ranges(ctx: Context) -> None:
    for key, rule in checks.RANGES.items():
        if key in ctx.cfg.flat and ctx.ok(key) and ctx.set_by_user_or_own(key):
            problem = rule.problem(key, ctx.get(key))
            if problem:
                ctx.add(problem)


def check_choices(ctx: Context) -> None:
    for key, choices in checks.CHOICES.items():
        value = ctx.get(key)
        if key not in ctx.cfg.flat or not ctx.ok(key) or value in choices or not ctx.set_by_user_or_own(key):
            continue
        if key == "reward_model.reward_manager" and class_from_file(ctx.cfg.flat):
            continue  # the name of the user's class (rlflow.config.verl.reward_class)
        names = [c for c in choices if c is not None]
        close = difflib.get_close_matches(str(value), names, n=1)
        ctx.add(f"{key}={value!r}: choose from {', '.join(names)}" + (f" (did you mean {close[0]}?)" if close else ""))


def check_registries(ctx: Context) -> None:
    for key, reg in checks.REGISTRIES.items():
        if ctx.ok(key):
            problem = reg.problem(ctx.get(key), key)
            if problem:
                ctx.add(problem)


# ---------------------------------------------------------------------------------------------- rules between keys

CROSS_CHECKS: list[Callable[[Context], None]] = []


def cross_check(fn: Callable[[Context], None]) -> Callable[[Context], None]:
    """Register a rule between keys (it reads ``ctx.get`` and calls ``ctx.add`` for each problem)."""
    CROSS_CHECKS.append(fn)
    return fn


def mini_batch_key(ctx: Context) -> str:
    """The ``ppo_mini_batch_size`` the Trainer uses for actor and critic alike (the plan's ``shared`` rule): the
    critic's when only the critic's is set (verl's PPO example), else the actor's."""
    actor, critic = f"{A}.ppo_mini_batch_size", f"{C}.ppo_mini_batch_size"
    if ctx.with_critic and ctx.cfg.is_provided(critic) and not ctx.cfg.is_provided(actor):
        return critic
    return actor


@cross_check
def batch_units(ctx: Context) -> None:
    """verl's units: mini-batches count prompts and divide the batch; micro-batches count trajectories."""
    key = mini_batch_key(ctx)
    bs, mini, n = ctx.get("data.train_batch_size"), ctx.get(key), ctx.get(f"{R}.n")
    if not all(map(positive_int, (bs, mini, n))):
        return  # a range problem, reported already
    if mini > bs or bs % mini:
        why = (f"; it applies to the actor too, whose {A}.ppo_mini_batch_size is not set: rlflow's Trainer uses one "
               "mini-batch size for both" if key.startswith(C) else "")
        ctx.add(f"data.train_batch_size={bs} must be a multiple of {key}={mini} (both count prompts{why})")
    micro = ctx.get(f"{A}.ppo_micro_batch_size_per_gpu")
    if micro is None and positive_int(ctx.get(f"{A}.ppo_micro_batch_size")) and ctx.processes:
        micro = max(1, ctx.get(f"{A}.ppo_micro_batch_size") // ctx.processes)
    if positive_int(micro) and (mini * n) % micro:
        ctx.add(f"a mini-batch holds ppo_mini_batch_size x rollout.n = {mini} x {n} = {mini * n} trajectories, "
                f"not a multiple of {A}.ppo_micro_batch_size_per_gpu={micro}")


@cross_check
def prompts_split_over_processes(ctx: Context) -> None:
    """Each process takes an equal share of a step's prompts (``rlflow.trainer.distributed.rank_shard``)."""
    bs, per_node, nnodes = (ctx.get(k) for k in ("data.train_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes"))
    if not all(map(positive_int, (bs, per_node, nnodes))):
        return  # a range problem, reported already
    if bs % (per_node * nnodes):
        ctx.add(f"data.train_batch_size={bs} must be a multiple of the number of processes, trainer.n_gpus_per_node "
                f"x trainer.nnodes = {per_node} x {nnodes} = {per_node * nnodes}: each process takes an equal share "
                "of a step's prompts")


@cross_check
def one_micro_size(ctx: Context) -> None:
    """verl's per-GPU micro size and its deprecated global form: at most one of each pair."""
    pairs = [(f"{A}.ppo_micro_batch_size_per_gpu", f"{A}.ppo_micro_batch_size"),
             (f"{R}.log_prob_micro_batch_size_per_gpu", f"{R}.log_prob_micro_batch_size"),
             ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
              "actor_rollout_ref.ref.log_prob_micro_batch_size")]
    if ctx.with_critic:
        pairs += [(f"{C}.ppo_micro_batch_size_per_gpu", f"{C}.ppo_micro_batch_size"),
                  (f"{C}.forward_micro_batch_size_per_gpu", f"{C}.forward_micro_batch_size")]
    for per_gpu, global_ in pairs:
        a, b = ctx.get(per_gpu), ctx.get(global_)
        if a is not None and b is not None:
            ctx.add(f"set only one of {per_gpu}={a} and {global_}={b} (the latter is deprecated)")


ALIASES = (  # names of one setting: verl 0.9's, older verl's, the seed's
    (f"{A}.optim.lr", f"{A}.lr"), (f"{A}.optim.clip_grad", f"{A}.grad_clip", f"{A}.max_grad_norm"),
    (f"{C}.optim.clip_grad", f"{C}.grad_clip"),
    (f"{A}.tau_pos", f"{A}.policy_loss.tau_pos"), (f"{A}.tau_neg", f"{A}.policy_loss.tau_neg"))


@cross_check
def aliases_agree(ctx: Context) -> None:
    """Two names of one setting (:data:`ALIASES`), both set, must not disagree."""
    for names in ALIASES:
        given = [(k, ctx.get(k)) for k in names if k in ctx.cfg.provided and ctx.get(k) is not None]
        if len({v for _, v in given}) > 1:
            ctx.add(f"{' and '.join(f'{k}={v}' for k, v in given)} disagree: they name one setting; set only one")


@cross_check
def critic_when_needed(ctx: Context) -> None:
    algo = ctx.get("algorithm.adv_estimator")
    if algo in checks.NEEDS_CRITIC and ctx.get("critic.enable") is False:
        ctx.add(f"algorithm.adv_estimator={algo} needs a critic, but critic.enable=False")


@cross_check
def dynamic_sampling(ctx: Context) -> None:
    fg = "algorithm.filter_groups"
    if not ctx.get(f"{fg}.enable"):
        return
    metric = ctx.get(f"{fg}.metric")
    if metric is None:
        ctx.add(f"{fg}.enable=True needs {fg}.metric: {', '.join(tables.FILTER_METRICS)} "
                "(or a column of the scorer's result dict)")
    elif metric == "seq_final_reward" and ctx.get("algorithm.use_kl_in_reward"):
        ctx.add(NotSupportedError(f"{fg}.metric", metric, "filtering on the KL-penalised reward",
                                  "rlflow filters before the KL penalty is applied; use seq_reward."))


@cross_check
def distillation(ctx: Context) -> None:
    for problem in distillation_loss_problems(ctx.get):  # what rlflow.config.verl.distillation cannot build
        ctx.add(problem)


@cross_check
def overlong_buffer(ctx: Context) -> None:
    """DAPO's overlong shaping: only with the dapo reward manager; its buffer fits the response length."""
    ob = "reward_model.reward_kwargs.overlong_buffer_cfg"
    kwargs = ctx.cfg.tree.get("reward_model", {}).get("reward_kwargs") or {}
    buffer = kwargs.get("overlong_buffer_cfg")
    if buffer is None:
        return
    if ctx.get("reward_model.reward_manager") != "dapo":
        ctx.add(f"{ob}: overlong shaping is verl's DAPO reward manager's; set reward_model.reward_manager=dapo")
        return
    if not isinstance(buffer, dict) or not buffer.get("enable"):
        return
    unknown = set(buffer) - {"enable", "len", "penalty_factor", "log"}
    if unknown or "len" not in buffer:
        ctx.add(f"{ob}: needs len (and optionally penalty_factor, log); "
                f"{'unknown: ' + ', '.join(sorted(unknown)) if unknown else 'len is missing'}")
        return
    max_len = kwargs.get("max_resp_len") or ctx.get(f"{R}.response_length")
    if isinstance(max_len, int) and not (isinstance(buffer["len"], int) and 0 < buffer["len"] <= max_len):
        ctx.add(f"{ob}.len={buffer['len']}: must be in (0, max_resp_len={max_len}] (max_resp_len defaults "
                "to data.max_response_length)")


@cross_check
def batch_reward_manager(ctx: Context) -> None:
    if ctx.get("reward_model.reward_manager") == "batch" and not ctx.get("custom_reward_function.path"):
        ctx.add("reward_model.reward_manager=batch needs custom_reward_function.path: the built-in scorers score "
                "one sample at a time")


@cross_check
def resume(ctx: Context) -> None:
    if ctx.get("trainer.resume_mode") == "resume_path" and not ctx.get("trainer.resume_from_path"):
        ctx.add("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>")


@cross_check
def val_only_needs_data(ctx: Context) -> None:
    if ctx.get("trainer.val_only") and not ctx.get("data.val_files"):
        ctx.add("trainer.val_only=True needs data.val_files")


@cross_check
def loggers(ctx: Context) -> None:
    names = ctx.get("trainer.logger") or []
    for name in names if isinstance(names, list) else [names]:
        if name in tables.VERL_ONLY_LOGGERS:
            ctx.add(NotSupportedError("trainer.logger", name, f"the {name} logger", (
                f"It needs {tables.VERL_ONLY_LOGGERS[name]}. The same metrics: every run writes "
                f"metrics.jsonl in trainer.default_local_dir; other loggers: {', '.join(tables.LOGGERS)}.")))
        elif name not in tables.LOGGERS:
            ctx.add(f"trainer.logger: unknown logger {name!r}; choose from {', '.join(tables.LOGGERS)}")
        elif "trainer.logger" in ctx.cfg.provided and tables.logger_install(name):
            ctx.add(f"trainer.logger contains {name}, which is not installed: {tables.logger_install(name)}")


@cross_check
def rollout_engine_available(ctx: Context) -> None:
    """The engine ``rollout.name`` asks for can run here (the rules of ``rlflow.config.verl.rollout.rollout_class``,
    read without importing the engines): a server rollout has its URL, an in-process engine its package, and
    rlflow has the class (read from ``rlflow.rollout``'s source)."""
    name, server = ctx.get(f"{R}.name"), ctx.get(f"{R}.server.url")
    if name not in tables.ROLLOUT_ENGINES:
        return  # a choice problem
    package, cls_name = tables.ROLLOUT_ENGINES[name]
    if ctx.get(f"{R}.enable_vision") and name != "hf":  # before "install it": installing would not help
        cls_name = tables.SERVER_ROLLOUTS.get(name, cls_name) if server else cls_name
        ctx.add(f"{R}.name={name} with {R}.enable_vision=True: {cls_name} takes no images yet (vLLM's multimodal "
                f"path needs torchvision, which rlflow's CPU install removes; docs/vision.md); set {R}.name=hf")
        return
    if server:
        if name not in tables.SERVER_ROLLOUTS:
            ctx.add(f"{R}.server.url is set but {R}.name={name!r} has no server rollout; use "
                    f"{' or '.join(tables.SERVER_ROLLOUTS)}")
        return
    if name in tables.SERVER_ROLLOUTS and package is None:
        ctx.add(f"{R}.name={name}: rlflow talks to a running {name} server; set {R}.server.url=http://HOST:PORT "
                f"(and {R}.server.launch='command' to have rlflow start it)")
    elif not module_defines("rlflow.rollout", cls_name):  # before "install it": installing would not help
        ctx.add(NotSupportedError(f"{R}.name", name, f"the {name} rollout engine", f"Use {R}.name=hf."))
    elif package is not None and importlib.util.find_spec(package) is None:
        ctx.add(f"{R}.name={name}: {package} is not installed here. Install it: {tables.ENGINE_INSTALL}. "
                f"Or generate with transformers: {R}.name=hf")


@cross_check
def rollout_routing(ctx: Context) -> None:
    """MoE routing replay from the rollout (verl's R3) needs an engine that returns the routed experts: HFRollout's,
    or VLLMRollout's on a CUDA GPU (vLLM's Model Runner V2)."""
    key, name, server = f"{R}.enable_rollout_routing_replay", ctx.get(f"{R}.name"), ctx.get(f"{R}.server.url")
    if not ctx.get(key) or (name == "hf" and not server) or name not in tables.ROLLOUT_ENGINES:
        return
    device = ctx.get("trainer.device")
    if name == "vllm" and not server and (device == "cuda" or (device == "auto" and verl_devices.cuda_count() > 0)):
        return  # VLLMRollout(return_routed_experts=True)
    cls_name = tables.SERVER_ROLLOUTS.get(name, name) if server else tables.ROLLOUT_ENGINES[name][1]
    in_process_vllm = name == "vllm" and not server
    why = VLLM_ROUTING if in_process_vllm else f"{cls_name}'s engine does not return the routed experts"
    where = " on CPU" if in_process_vllm else ""
    # no other apostrophe than verl's: the verl-examples harness reads the reason with quoted text taken out
    ctx.add(NotSupportedError(key, True, f"MoE routing replay from the rollout with {cls_name}{where} (verl's R3)",
                              f"{why}. {R}.name=hf records them (HFRollout(return_routed_experts=True)); "
                              f"{A}.megatron.router_replay.mode=R2 replays the routing of the old-log-prob pass "
                              "instead."))


@cross_check
def multi_token_prediction(ctx: Context) -> None:
    """verl's ``model.mtp``: the checkpoint's MTP layers in megatron-core's MTP block, so under the Megatron strategy
    (as in verl: mbridge + Megatron); speculative decoding drafted by them is refused."""
    key = "actor_rollout_ref.model.mtp"
    if not ctx.get(f"{key}.enable"):
        return
    strategy = ctx.get(f"{A}.strategy")
    # no apostrophe in the reasons: the verl-examples harness reads them with quoted text taken out
    if strategy != "megatron":
        ctx.add(NotSupportedError(f"{key}.enable", True, f"multi-token prediction with {A}.strategy={strategy}",
                                  "rlflow trains MTP layers in the MTP block of megatron-core, as verl does: set "
                                  f"model_engine=megatron or {A}.strategy=megatron."))
    if ctx.get(f"{key}.enable_rollout"):
        name = ctx.get(f"{R}.name")
        engine = "the SGLang server" if name == "sglang" else f"{R}.name={name}"
        ctx.add(NotSupportedError(f"{key}.enable_rollout", True, f"speculative decoding drafted by the MTP layers with "
                                  f"{engine}", "The weight sync of rlflow sends an engine the main model only, never "
                                  "the MTP layers a draft reads (an SGLang server drafts with the MTP layers of the "
                                  "checkpoint it loaded, set at its launch); HFRollout and the vLLM engine of rlflow "
                                  f"start without a speculative config. Training the layers ({key}.enable_train) does "
                                  "not need it."))


VLLM_ROUTING = ("vLLM returns routed experts only from its GPU Model Runner V2, which needs a CUDA GPU and "
                "Triton (trainer.device=cuda); on CPU vLLM runs its V1 runner, which refuses them (AuxOutput Connector "
                "requires Model Runner V2)")


@cross_check
def sequence_parallel(ctx: Context) -> None:
    keys = sequence_parallel_keys(ctx.get, ctx.cfg.is_provided, ctx.with_critic)  # verl 0.9: or the engine's key
    sizes = {k: ctx.get(k) for k in keys}
    if not all(map(positive_int, sizes.values())):
        return
    size = sizes[keys[0]]
    if size <= 1:
        others = [k for k in keys[1:] if sizes[k] > 1]
        if others:
            ctx.add(f"{', '.join(others)} > 1 but {keys[0]}={size}: rlflow uses one sequence-parallel size for "
                    f"every role; set {keys[0]}")
        return
    if ctx.processes and ctx.processes % size:
        ctx.add(f"{keys[0]}={size} must divide the number of processes ({ctx.processes})")
    padded = [k for k in ["actor_rollout_ref.model.use_remove_padding"] + (
        [f"{C}.model.use_remove_padding"] if ctx.with_critic else []) if not ctx.get(k)]
    if padded:
        ctx.add(f"{keys[0]}={size}: sequence parallelism runs on packed sequences; set "
                f"{' and '.join(f'{k}=True' for k in padded)}")


@cross_check
def covariance_bounds(ctx: Context) -> None:
    lb, ub = ctx.get(f"{A}.policy_loss.clip_cov_lb"), ctx.get(f"{A}.policy_loss.clip_cov_ub")
    if isinstance(lb, (int, float)) and isinstance(ub, (int, float)) and lb >= ub:
        ctx.add(f"{A}.policy_loss.clip_cov_lb={lb} must be below {A}.policy_loss.clip_cov_ub={ub}")


@cross_check
def adam_betas(ctx: Context) -> None:
    for role in (A, C):
        key = f"{role}.optim.betas"
        betas = ctx.get(key)
        if key in ctx.cfg.flat and ctx.ok(key) and ctx.set_by_user_or_own(key) and not (
                isinstance(betas, list) and len(betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            ctx.add(f"{key}={betas!r}: must be two numbers in [0, 1)")


@cross_check
def external_lib(ctx: Context) -> None:
    name = ctx.get("actor_rollout_ref.model.external_lib")
    if name and importlib.util.find_spec(name.split(".")[0]) is None:
        ctx.add(f"actor_rollout_ref.model.external_lib={name!r}: no importable module of that name")


# ---------------------------------------------------------------------------------------------- devices

def check_devices(ctx: Context) -> None:
    if not all(positive_int(ctx.get(k)) for k in ("trainer.n_gpus_per_node", "trainer.nnodes")):
        return  # a type or range problem, reported by its own check
    try:
        devices = resolve_devices(ctx.cfg, [], ctx.with_critic, record=False)
    except ConfigError as e:
        ctx.add(e)
    else:
        ctx.processes = devices.processes


# ---------------------------------------------------------------------------------------------- entry points

def validate(cfg: VerlConfig, environment: bool = False, dry_run: bool = False) -> list[ConfigError]:
    """Every problem of ``cfg`` (see the module docstring); an empty list when it is fine. ``dry_run``: model
    folders need a config and a tokenizer, not weights."""
    ctx = Context(cfg, environment, dry_run)
    for step in (check_not_supported, check_ranges, check_choices, check_registries, check_devices):
        step(ctx)
    for rule in CROSS_CHECKS:
        try:
            rule(ctx)
        except (TypeError, ValueError, AttributeError):  # a value of the wrong shape: reported by its own check
            continue
    if environment:
        check_environment(ctx)

    return user_names(ctx.problems, cfg.aliased)  # a problem of reward_model.x set as reward.y names both


def check(cfg: VerlConfig, environment: bool = False) -> None:
    """:func:`validate`, raising every problem at once (one :class:`ConfigError`)."""
    raise_problems(validate(cfg, environment))
