"""``trainer.async_weight_update`` (the seed's key) and verl's ``async_training.*`` -> ``AsyncRollout``.

The seed answers "slow weight sync / long waits between rollout and training" with
``trainer.async_weight_update=true``; verl's fully-async recipe bounds how far generation runs ahead with
``async_training.staleness_threshold``. In rlflow either one turns on the asynchronous mode: the rollout is
wrapped as ``AsyncRollout(rollout, max_staleness=k)`` (docs/async.md), and truncated importance sampling
(``algorithm.rollout_correction.rollout_is=token``) is switched on unless the config says otherwise.

verl counts ``staleness_threshold`` as a fraction of a batch that may come from older weights; rlflow
generates whole batches ahead, so the value must be a whole number of steps: 0 (synchronous, the engine
in its own process), 1 (one-step-off, the default), 2, ...

``async_training.max_engine_restarts`` (rlflow's key, default 2): how often a generation process that died
is started again in one run (``ProcessEngine``, one-step-off), before the run stops naming it; the fully asynchronous modes stop the run
at the first death (their driver thread cannot fork a new process safely).

verl 0.9's V1 asynchronous modes (``trainer.use_v1=True``, ``trainer.v1.trainer_mode=colocate_async`` or
``separate_async``) are fully asynchronous with partial rollouts: the rollout is wrapped as
``FullyAsyncRollout(rollout, max_off_policy_threshold, max_off_policy_strategy, num_warmup_batches)`` from
``trainer.v1.sampler.*`` and ``trainer.v1.<mode>.num_warmup_batches`` (docs/async.md), with the same IS default.
``trainer.v1.sampler.custom_sampler.path`` / ``.name`` with ``sampler_kwargs``: verl's custom replay-buffer sampler,
``FullyAsyncRollout(sampler=cls(**sampler_kwargs))``, a ``GroupSampler`` choosing which finished groups form each
batch (refused in sync mode, where there is no choice, and for a class written against verl's ReplayBuffer).

With ``algorithm.filter_groups`` (DAPO's dynamic sampling) the fully asynchronous modes filter group by group: a
finished group with a constant metric is replaced by the next one to finish (``FilterGroups`` over a stream of
groups; ``max_num_gen_batches`` x the batch's prompts bounds the groups scored per step). One step off, the top-up
batches are batches of the stream like any other, generated ahead by the engine within the staleness bound.
With several training processes the asynchronous modes run the engine on rank 0, which hands every rank whole
groups of each step (``rlflow.rollout.ranks``); with dynamic sampling rank 0 also scores and filters, and hands
out only kept groups.

With ``multi_turn.enable`` the fully asynchronous modes wrap the agent loop, ``FullyAsyncRollout(AgentLoop(...))``:
its conversations run beside training, a weight update lands between two chunks of a turn (``pause_mode`` chunks),
and the engine must be a server or ``hf`` (the loop samples with a copy of the model); vLLM in the trainer's process
is refused, naming a server or one step off.

``async_training.pause_mode`` (rlflow's key; verl has none, it aborts and resends): how partial rollouts continue
a request across a weight update, FullyAsyncRollout's ``pause_mode``: ``auto`` (the default: requests kept with
vLLM's ``pause_generation(mode="keep")`` where the engine has it, a vLLM server; chunks elsewhere), ``keep``
(refused where the engine lacks it) or ``chunks``.

verl's fully-async recipe keys map onto the same two classes. ``async_training.partial_rollout=True`` (verl's mode
"async stream pipeline with partial rollout") is ``FullyAsyncRollout(max_off_policy_threshold=None,
num_warmup_batches=staleness_threshold)``: verl lets the rollouter generate at most ``(1 + staleness_threshold)``
sync cycles' samples ahead of training and bounds nothing else, and that is the pacing of FullyAsyncRollout's
warm-up batches without an age bound; fractions are allowed here (the recipe's default, 0.1, when the threshold
is not set). verl: "partial_rollout only takes effect when staleness_threshold>0", so with 0 the run is the
synchronous one. ``trigger_parameter_sync_step`` x ``require_batches`` x ``ppo_mini_batch_size`` prompts are
trained between two weight syncs in verl; rlflow syncs once per step of ``data.train_batch_size`` prompts, so the
keys are honoured when the batch is that product (verl's own advice for comparing with colocate), and refused
otherwise, naming the batch size that makes them agree.
"""

from __future__ import annotations

from rlflow.config.verl import tables
from rlflow.config.verl.devices import Devices
from rlflow.config.verl.loading import ConfigError, NotSupportedError, VerlConfig
from rlflow.config.verl.user_classes import load_user_class

STALENESS = "async_training.staleness_threshold"
SWITCH = "trainer.async_weight_update"
IS_LEVEL, IS_THRESHOLD = "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"
BYPASS = "algorithm.rollout_correction.bypass_mode"
RESTARTS = "async_training.max_engine_restarts"  # rlflow's: the engine's process started again after it died
USE_V1, MODE = "trainer.use_v1", "trainer.v1.trainer_mode"
THRESHOLD, STRATEGY = "trainer.v1.sampler.max_off_policy_threshold", "trainer.v1.sampler.max_off_policy_strategy"
PARTIAL = "async_training.partial_rollout"
PAUSE, PAUSE_MODES = "async_training.pause_mode", ("auto", "keep", "chunks")  # rlflow's: FullyAsyncRollout's pause_mode
SYNC_STEP, REQUIRE = "async_training.trigger_parameter_sync_step", "async_training.require_batches"
RECIPE_STALENESS = 0.1  # verl's fully_async_ppo_trainer.yaml: the bound partial rollouts get when it is not set
SAMPLER_PATH, SAMPLER_NAME = "trainer.v1.sampler.custom_sampler.path", "trainer.v1.sampler.custom_sampler.name"
SAMPLER_KWARGS = "trainer.v1.sampler.sampler_kwargs"
SAMPLER_HOW = ("subclass rlflow.rollout.group_sampler.GroupSampler and override choose(groups, k, step) -> k indices "
               "into groups (each group's prompt row, response token ids and age; docs/async.md#choosing-the-groups)")
MINI, EPOCHS = "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs"


def partial_rollouts(cfg: VerlConfig) -> bool:
    """``async_training.partial_rollout=True`` with a staleness bound above 0 (verl: only then does it act)."""
    return bool(cfg[PARTIAL]) and (not cfg.is_provided(STALENESS) or cfg[STALENESS] != 0)


def bypass_mode(cfg: VerlConfig) -> bool:
    """``algorithm.rollout_correction.bypass_mode``, or where the config leaves it unset and asks for verl's
    fully-async recipe with partial rollouts, that recipe's value: True (``fully_async_ppo_trainer.yaml``; PPO's
    clipped ratio against the sampler's log-probs). On the default job it learned more than decoupled truncated
    IS (docs/async.md, ``scripts/async_learning.py``)."""
    return bool(cfg[BYPASS]) if cfg.is_provided(BYPASS) or not partial_rollouts(cfg) else True


def with_filter(key: str, devices: Devices, dynamic_sampling: dict | None, notes: list[str], how: str) -> None:
    """Says how an asynchronous mode runs DAPO's dynamic sampling (``algorithm.filter_groups``), if it is on."""
    if not dynamic_sampling:
        return
    ranks = (f"; on the {devices.processes} training processes rank 0 scores and filters every group and hands "
             "each rank only kept whole groups, with the same dapo/* metrics") if devices.processes > 1 else ""
    notes.append(f"algorithm.filter_groups with {key}: {how}{ranks} (docs/async.md)")


def sync_cadence(cfg: VerlConfig, notes: list[str]) -> None:
    """verl's fully-async trainer syncs weights after ``trigger_parameter_sync_step`` local updates of
    ``require_batches`` mini-batches each; rlflow after each step: the same when the batch is their product."""
    trigger, require = cfg[SYNC_STEP], cfg[REQUIRE]  # read in every plan: both are honoured at their defaults (1)
    if not (cfg.is_provided(SYNC_STEP) or cfg.is_provided(REQUIRE)):
        return
    for key in (SYNC_STEP, REQUIRE):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r}: an integer >= 1")
    mini, batch = cfg[MINI], cfg["data.train_batch_size"]
    cycle = trigger * require * mini
    if batch != cycle:
        raise ConfigError(f"{SYNC_STEP}={trigger}, {REQUIRE}={require}: verl syncs the weights every {trigger} x "
                          f"{require} x ppo_mini_batch_size = {cycle} prompts, rlflow once per step of "
                          f"data.train_batch_size={batch}; set data.train_batch_size={cycle} to get verl's cadence")
    if trigger > 1 and cfg[EPOCHS] > 1:
        raise ConfigError(f"{SYNC_STEP}={trigger} with {EPOCHS}={cfg[EPOCHS]}: verl runs the epochs over each of "
                          f"the {trigger} local batches, rlflow over the whole step's batch; set {EPOCHS}=1, or "
                          f"{SYNC_STEP}=1 with {REQUIRE}={trigger * require} (the same cadence, epochs over the step)")
    notes.append(f"{SYNC_STEP}={trigger}, {REQUIRE}={require}: the weights are synced once per step of "
                 f"data.train_batch_size={batch} prompts = {trigger} x {require} mini-batches of {mini}, as verl's sync "
                 "cycle; the step's batch is trained once it is complete (batch statistics such as advantage "
                 "whitening and the logged metrics are over the step, not each local batch)")


def async_plan(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, dynamic_sampling: dict | None
               ) -> dict | None:
    """AsyncRollout's kwargs, or None when the mode is off; appends the IS correction to ``after`` (the
    modules chained after the estimator) when the config leaves it unset."""
    switch, steps = cfg[SWITCH], cfg[STALENESS]
    if not (switch or cfg.is_provided(STALENESS)) or partial_rollouts(cfg):
        return None  # off, or partial rollouts: FullyAsyncRollout (v1_async_plan)
    if cfg[PARTIAL]:
        notes.append(f"{PARTIAL}=True with {STALENESS}=0: no effect (verl: partial rollouts act only with a "
                     "threshold above 0); generation is synchronous, the engine in its own process")
    key = STALENESS if cfg.is_provided(STALENESS) else SWITCH
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps < 0 or steps != int(steps):
        raise ConfigError(f"{STALENESS}={steps!r}: rlflow generates whole batches ahead, so the bound is a whole "
                          "number of steps (0: synchronous, 1: one-step-off, the default; 2, ...); verl's fractional "
                          "values allow part of a batch: round up for more overlap, down for fresher samples, or "
                          f"set {PARTIAL}=True (fully asynchronous, where fractions are the generation ahead)")
    with_filter(key, devices, dynamic_sampling, notes, "the engine generating ahead generates the top-up batches "
                "too, each one a batch of the stream within the staleness bound")
    correction(cfg, notes, after, key)
    notes.append(f"{key}: the Trainer gets rollout=AsyncRollout(rollout, max_staleness={int(steps)}) (the engine "
                 "runs beside the trainer; docs/async.md)")
    restarts = {"max_engine_restarts": int(cfg[RESTARTS])} if cfg.is_provided(RESTARTS) else {}  # else its default
    return {"max_staleness": int(steps)} | restarts


def v1_async_plan(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, dynamic_sampling: dict | None
                  ) -> dict | None:
    """FullyAsyncRollout's kwargs for verl V1's asynchronous modes, or None (``sync``, or the legacy trainer)."""
    mode = cfg[MODE]
    sampler = group_sampler(cfg, notes)
    if sampler is not None and (not cfg[USE_V1] or mode == "sync"):
        raise ConfigError(f"{SAMPLER_PATH}={cfg[SAMPLER_PATH]!r} chooses which finished groups form a batch, which "
                          f"only the asynchronous modes have ({MODE}=colocate_async or separate_async; in sync mode "
                          "every step trains the batch it generated): set one, or drop the sampler")
    if not cfg[USE_V1] or mode == "sync":
        return partial_plan(cfg, notes, devices, after, dynamic_sampling) if partial_rollouts(cfg) else None
    if cfg[PARTIAL]:
        raise ConfigError(f"{MODE}={mode!r} and {PARTIAL}=True both ask for fully asynchronous generation, from "
                          f"verl's V1 trainer and its fully-async recipe; set one of them")
    if cfg[SWITCH] or cfg.is_provided(STALENESS):
        other = SWITCH if cfg[SWITCH] else STALENESS
        raise ConfigError(f"{MODE}={mode!r} and {other}={cfg[other]!r} choose two asynchronous modes: fully "
                          f"asynchronous with partial rollouts ({MODE}) or one-step-off ({other}); set one of them")
    with_filter(MODE, devices, dynamic_sampling, notes, "a filtered group is replaced by the next one to finish")
    threshold, strategy = cfg[THRESHOLD], cfg[STRATEGY]
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
        raise ConfigError(f"{THRESHOLD}={threshold!r}: an integer >= 1 (model versions from a prompt's first "
                          "generation to its training; 1: trained on the weights it was admitted under) or null")
    if strategy not in ("drop", "wait"):
        raise ConfigError(f"{STRATEGY}={strategy!r}: choose from drop, wait")
    warmup_key = f"trainer.v1.{mode}.num_warmup_batches"
    warmup = cfg[warmup_key]
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or warmup < 0:
        raise ConfigError(f"{warmup_key}={warmup!r}: a number of batches >= 0")
    correction(cfg, notes, after, MODE)
    kwargs = {"max_off_policy_threshold": threshold, "max_off_policy_strategy": strategy,
              "num_warmup_batches": warmup} | pause_mode(cfg) | ({"sampler": sampler} if sampler else {})
    notes.append(f"{MODE}={mode}: the Trainer gets rollout=FullyAsyncRollout(rollout, "
                 + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ") (generation runs beside training with "
                 "partial rollouts; the engine in its own process or a server driven from a thread, in either mode; "
                 "docs/async.md)")
    return kwargs


def partial_plan(cfg: VerlConfig, notes: list[str], devices: Devices, after: list, dynamic_sampling: dict | None
                 ) -> dict:
    """FullyAsyncRollout's kwargs for verl's fully-async recipe with ``partial_rollout=True``."""
    if cfg[SWITCH]:
        raise ConfigError(f"{PARTIAL}=True and {SWITCH}=True choose two asynchronous modes: fully asynchronous with "
                          f"partial rollouts ({PARTIAL}) or one-step-off ({SWITCH}); set one of them")
    ahead = cfg[STALENESS] if cfg.is_provided(STALENESS) else RECIPE_STALENESS
    if isinstance(ahead, bool) or not isinstance(ahead, (int, float)) or ahead < 0:
        raise ConfigError(f"{STALENESS}={ahead!r}: with {PARTIAL}=True, the sync cycles' worth of samples generated "
                          "ahead of training (verl's fraction, e.g. 0.1; whole numbers too), a number >= 0")
    with_filter(PARTIAL, devices, dynamic_sampling, notes, "a filtered group is replaced by the next one to finish")
    correction(cfg, notes, after, PARTIAL)
    kwargs = {"max_off_policy_threshold": None, "max_off_policy_strategy": "drop",
              "num_warmup_batches": ahead} | pause_mode(cfg)
    source = "" if cfg.is_provided(STALENESS) else f", verl's recipe default for {STALENESS}"
    notes.append(f"{PARTIAL}=True: the Trainer gets rollout=FullyAsyncRollout(rollout, "
                 + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + f") (at most {1 + ahead} batches generated "
                 f"ahead of training{source}; no age bound, as verl's recipe; docs/async.md)")
    return kwargs


def pause_mode(cfg: VerlConfig) -> dict:
    """FullyAsyncRollout's ``pause_mode`` from ``async_training.pause_mode`` (nothing when not set: its default)."""
    if not cfg.is_provided(PAUSE):
        return {}
    if cfg[PAUSE] not in PAUSE_MODES:
        raise ConfigError(f"{PAUSE}={cfg[PAUSE]!r}: choose from {', '.join(PAUSE_MODES)} (keep: requests kept across "
                          "weight updates, vLLM's pause_generation(mode='keep'); chunks: partial rollouts by chunks)")
    return {"pause_mode": cfg[PAUSE]}


def correction(cfg: VerlConfig, notes: list[str], after: list, key: str) -> None:
    """Truncated IS against the sampler's log-probs unless the config sets the correction (or bypass mode)."""
    if bypass_mode(cfg):  # the loss corrects against the sampler (rlflow.algorithms.bypass); nothing to add here
        recipe = "" if cfg.is_provided(BYPASS) else (" (verl's fully-async recipe default; set it to false for "
                                                     "decoupled truncated importance sampling)")
        notes.append(f"{key} with {BYPASS}=True{recipe}: the loss's ratio (or its IS weights) is taken against the "
                     "sampler's log-probs, which correct for the stale weights")
    elif not cfg.is_provided(IS_LEVEL) and not any(cls.__name__ == tables.ROLLOUT_IS for cls, _ in after):
        import rlflow.algorithms

        after.append((getattr(rlflow.algorithms, tables.ROLLOUT_IS), {"level": "token",
                                                                      "threshold": cfg[IS_THRESHOLD]}))
        notes.append(f"{key}: truncated importance sampling is on ({IS_LEVEL}=token, threshold "
                     f"{cfg[IS_THRESHOLD]}); set {IS_LEVEL}=null to train without it")
    elif cfg[IS_LEVEL] is None:
        notes.append(f"{key} with {IS_LEVEL}=null: stale samples are trained without importance-sampling correction")


def multi_turn_async(cfg: VerlConfig, notes: list[str], asynchronous: dict | None, fully_async: dict | None,
                     engine: str) -> None:
    """Multi-turn rollouts (``multi_turn.enable``: an ``AgentLoop`` around the rollout class named ``engine``) with
    asynchronous generation: one step off runs each batch's loop beside the trainer; fully asynchronous generation
    runs the conversations on its driver thread, where the engine must take requests from two threads (a server) or
    sample with a copy of the model (hf)."""
    if fully_async is not None:
        key = PARTIAL if partial_rollouts(cfg) else MODE
        if engine not in ("HFRollout", *tables.SERVER_ROLLOUTS.values()):
            raise NotSupportedError(
                "actor_rollout_ref.rollout.multi_turn.enable", True,
                f"multi-turn rollouts with fully asynchronous generation ({key}={cfg[key]!r}) on {engine}: the "
                "conversations are generated from a thread beside the trainer, which validates from its own, and the "
                "engine in this process serves one caller at a time",
                f"Use a server (actor_rollout_ref.rollout.server.url) or actor_rollout_ref.rollout.name=hf; or one "
                f"step off: {SWITCH}=true instead of {key}.")
        if fully_async.get("pause_mode") == "keep":
            raise ConfigError(f"{PAUSE}=keep with multi_turn.enable: an agent loop's turns are requests of their own, "
                              f"generated by chunks; set {PAUSE}=chunks (or auto)")
        notes.append(f"multi_turn.enable with {key}={cfg[key]!r}: the rollout is FullyAsyncRollout(AgentLoop(...)); "
                     "the conversations run on a thread beside the trainer, their turns generated by chunks (a weight "
                     "update lands between two chunks), each token with its version and log-prob "
                     "(docs/async.md#multi-turn-fully-asynchronous)")
    elif asynchronous is not None:
        notes.append("multi_turn.enable with asynchronous generation: the rollout is AsyncRollout(AgentLoop(...)); "
                     "each batch's whole loop (turns and tools) runs on a thread beside the trainer, sampling with a "
                     "copy of the model (hf) or the engine's own weights (docs/async.md#multi-turn-agent-rollouts)")


def _verl_sampler_methods(method) -> list[str]:
    return ["it implements verl's ReplayBuffer sample(global_steps, partition_id, batch_size)"] \
        if method.name == "sample" else []


def group_sampler(cfg: VerlConfig, notes: list[str]):
    """The user's ``GroupSampler`` built with ``sampler_kwargs`` (verl's custom replay-buffer sampler); None when
    none is set."""
    path, name, kwargs = cfg[SAMPLER_PATH], cfg[SAMPLER_NAME], dict(cfg[SAMPLER_KWARGS] or {})
    if not path:
        return None
    if not name or not str(name).isidentifier():
        raise ConfigError(f"{SAMPLER_NAME}={name!r}: the class name in {SAMPLER_PATH}={path!r}")
    cls = load_user_class("group sampler", "rlflow.rollout.group_sampler:GroupSampler", str(path), str(name),
                          f"{SAMPLER_PATH}={path!r}", "replay-buffer sampler", SAMPLER_HOW, _verl_sampler_methods)
    try:
        sampler = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{SAMPLER_KWARGS}={kwargs!r}: {name}({', '.join(kwargs)}) failed: {e}") from None
    notes.append(f"{SAMPLER_PATH}: FullyAsyncRollout(sampler={sampler!r}) chooses which finished groups form each "
                 "batch (groups at the staleness bound are taken first; docs/async.md#choosing-the-groups)")
    return sampler
