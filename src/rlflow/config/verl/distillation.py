"""verl's ``distillation.*`` section -> the teacher stage and the distillation loss (:mod:`rlflow.algorithms.distillation`,
:mod:`rlflow.models.teacher`).

What verl does with it, and rlflow the same way:

- ``distillation_loss.loss_mode``: the per-token estimator (``k1``, ``k3``, ...); ``use_policy_gradient=True`` uses
  ``-d`` as an advantage (``PolicyGradientDistillationLoss``, with ``clip_ratio*``; ``policy_loss_mode`` must be
  ``vanilla``, as verl requires), ``False`` backpropagates ``d`` (``DistillationLoss``; ``k1`` refused, as verl).
- ``use_task_rewards=True``: the RL loss of ``actor.policy_loss`` plus ``distillation_loss_coef`` x the term;
  ``False``: the term alone (verl then uses coefficient 1). ``loss_max_clamp`` clamps ``d``. The aggregation is
  the actor's ``loss_agg_mode``.
- ``teacher_models``: the default ``teacher_model`` alone is the one teacher (every row); with other entries it is
  dropped (verl pops it) and rows are routed by ``teacher_key`` (``data_source``) to the entry whose ``key`` matches.

verl serves its teachers from inference servers of their own (``inference.*``, ``num_replicas``, ``n_gpus_per_node``,
``nnodes``); rlflow's teacher scores with transformers in the training processes, as the reference does, so those
keys get a note (``verl_0_9_keys``).
- ``loss_mode=forward_kl_topk``: the teacher stage writes its ``topk`` most likely tokens per position
  (``Teacher(top_k=topk)``) and the loss is the forward KL over them (``kind="forward_kl_topk"``, with
  ``log_prob_min_clamp``), backpropagated or (verl warns: the top-k signal is then mostly unused) as a reward.
"""

from __future__ import annotations

from typing import Any, Callable

from rlflow.config.errors import ConfigError, NotSupportedError, raise_problems
from rlflow.data import keys as K

D, L = "distillation", "distillation.distillation_loss"
DEFAULT = "teacher_model"  # verl's single-teacher entry
# rlflow.algorithms.distillation.KINDS, spelled out: validation imports this module without torch (a test compares)
KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOPK = "forward_kl_topk"  # rlflow.algorithms.distillation.TOPK


def loss_problems(get: Callable[[str], Any]) -> list[ConfigError]:
    """What of ``distillation_loss.*`` rlflow cannot build (``get``: a key's value); validation reports these with
    the config's other problems, the plan raises them."""
    if not get(f"{D}.enabled"):
        return []
    mode, pg = get(f"{L}.loss_mode"), bool(get(f"{L}.use_policy_gradient"))
    if mode == TOPK:
        return _topk_problems(get)
    if mode not in KINDS:
        return [ConfigError(f"{L}.loss_mode={mode!r}: choose one of {list(KINDS + (TOPK,))}")]
    if not pg and mode in ("k1", "kl"):
        return [ConfigError(f"{L}.loss_mode={mode} with use_policy_gradient=False: backpropagating k1 is incorrect, "
                            "its gradient does not depend on the teacher's log-probs (verl refuses it too); use k3, or "
                            "use_policy_gradient=True")]
    if pg and get(f"{L}.policy_loss_mode") != "vanilla":
        return [ConfigError(f"{L}.policy_loss_mode={get(f'{L}.policy_loss_mode')!r}: only 'vanilla' (dual-clip PPO) "
                            "is supported with use_policy_gradient=True, as in verl")]
    return []


def _topk_problems(get: Callable[[str], Any]) -> list[ConfigError]:
    topk, clamp = get(f"{L}.topk"), get(f"{L}.log_prob_min_clamp")
    problems = []
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        problems.append(ConfigError(f"{L}.topk={topk!r}: loss_mode={TOPK} needs the number of the teacher's most "
                                    "likely tokens to compare, a positive integer (verl's default 128)"))
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float))):
        problems.append(ConfigError(f"{L}.log_prob_min_clamp={clamp!r}: a number (a log-prob, e.g. -10.0) or null"))
    if get(f"{L}.use_policy_gradient") and get(f"{L}.policy_loss_mode") != "vanilla":
        problems.append(ConfigError(f"{L}.policy_loss_mode={get(f'{L}.policy_loss_mode')!r}: only 'vanilla' "
                                    "(dual-clip PPO) is supported with use_policy_gradient=True, as in verl"))
    return problems


def teachers(cfg: VerlConfig, notes: list[str]) -> tuple[dict, str | None]:
    """(one teacher, None) or ({route value: teacher}, route key) from ``distillation.teacher_models``; a teacher is
    ``{"path": its model_path, "key": that config key}``."""
    entries = dict(cfg.tree[D]["teacher_models"] or {})
    if len(entries) > 1 and DEFAULT in entries:
        if cfg.is_provided(f"{D}.teacher_models.{DEFAULT}"):
            notes.append(f"{D}.teacher_models.{DEFAULT} is dropped because other teachers are named, as verl drops it; "
                         f"give it a name of its own (+{D}.teacher_models.teacher_model1.*) to keep it")
        cfg[f"{D}.teacher_models.{DEFAULT}"]  # read: the note above says what happened to it
        entries.pop(DEFAULT)
    if not entries:
        raise ConfigError(f"{D}.enabled=True needs a teacher: set {D}.teacher_models.{DEFAULT}.model_path")
    route_key = cfg[f"{D}.teacher_key"]  # refused with one teacher too: what it asks for is not what rlflow does
    if route_key != K.DATA_SOURCE:
        raise NotSupportedError(f"{D}.teacher_key", route_key, "routing teachers by a field other than data_source",
                                "rlflow's batches carry data_source for each row; route by it.")
    paths = {}
    for name, entry in entries.items():
        key = f"{D}.teacher_models.{name}"

        def field(leaf: str):  # a +-added teacher may lack a field verl's dataclass defaults to None
            return cfg[f"{key}.{leaf}"] if isinstance(entry, dict) and leaf in entry else None

        path = field("model_path")
        if not path:
            raise ConfigError(f"{key}.model_path: the teacher's model is not set (distillation.enabled=True)")
        if len(entries) == 1:
            field("key")  # read: one teacher scores every row, whatever its key (verl's "default")
            return {"path": path, "key": f"{key}.model_path"}, None
        route = field("key")
        if route is None:
            raise ConfigError(f"{key}.key: with several teachers each needs the {cfg[f'{D}.teacher_key']} value of "
                              "the rows it scores (e.g. openai/gsm8k)")
        if str(route) in paths:
            raise ConfigError(f"{key}.key={route!r}: another teacher has this key already")
        paths[str(route)] = {"path": path, "key": f"{key}.model_path"}
    return paths, route_key


def distillation_plan(cfg: VerlConfig, notes: list[str]) -> dict | None:
    """The distillation part of the plan (``None`` unless ``distillation.enabled``): ``loss`` (a class name in
    ``rlflow.algorithms``, resolved by the plan) and
    ``loss_kwargs`` (without ``rl_loss``, filled in by the builder when ``rl`` is true), ``teachers`` and
    ``route_key`` for :class:`~rlflow.models.teacher.Teacher`."""
    if not cfg[f"{D}.enabled"]:
        return None
    raise_problems(loss_problems(lambda key: cfg[key]))
    mode, pg, rl = cfg[f"{L}.loss_mode"], bool(cfg[f"{L}.use_policy_gradient"]), bool(cfg[f"{L}.use_task_rewards"])
    kwargs = {"kind": mode, "coef": cfg[f"{L}.distillation_loss_coef"] if rl else 1.0,
              "max_clamp": cfg[f"{L}.loss_max_clamp"], "agg": cfg["actor_rollout_ref.actor.loss_agg_mode"],
              "loss_scale_factor": cfg["actor_rollout_ref.actor.loss_scale_factor"]}
    top_k = None
    if mode == TOPK:
        top_k = cfg[f"{L}.topk"]
        kwargs["log_prob_min_clamp"] = cfg[f"{L}.log_prob_min_clamp"]
        if pg:  # verl prints the same warning
            notes.append(f"{L}.loss_mode={TOPK} with use_policy_gradient=True: the update then uses only the "
                         "sampled token's log-prob gradient, so the top-k distributional signal is largely unused; "
                         "verl recommends use_policy_gradient=False for it")
    if pg:
        kwargs |= {k: cfg[f"{L}.{k}"] for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")}
    paths, route_key = teachers(cfg, notes)
    return {"loss": "PolicyGradientDistillationLoss" if pg else "DistillationLoss", "loss_kwargs": kwargs,
            "rl": rl, "teachers": paths, "route_key": route_key, "top_k": top_k}


def check_routes(distillation: dict | None, sources: set[str], where: str) -> None:
    """Several teachers must cover every ``data_source`` of the prompts (``where``: the data files), or a step would
    fail on its first row without a teacher."""
    if not distillation or distillation["route_key"] is None:
        return
    missing = sorted(set(map(str, sources)) - set(distillation["teachers"]))
    if missing:
        raise ConfigError(f"{D}.teacher_models: no teacher has key={missing[0]!r}, a data_source of {where} "
                          f"(teachers' keys: {sorted(distillation['teachers'])}); add "
                          f"+{D}.teacher_models.<name>.key={missing[0]} with its model_path")
