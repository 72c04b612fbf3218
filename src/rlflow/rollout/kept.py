"""FullyAsyncRollout's driver for engines that keep requests across a weight update (vLLM's
``pause_generation(mode="keep")``, through a vLLM server's ``/pause?mode=keep``).

Without chunks: each admitted group is one request of its prompt and ``n`` samples, sent once with the whole
``max_new_tokens``. A weight push pauses the engine with the requests in flight frozen and their KV cache kept,
loads the weights, labels them with the push's version and resumes; the requests go on under the new weights.
The engine reports, per response, which version's weights sampled which tokens (vLLM's ``weight_versions``), so
a token's version and its log-prob are those of the weights that sampled it. What differs from chunks: the KV
of the tokens before the pause is not recomputed (the old weights'), and no prefix is prefilled again.

The engine must offer ``submit_kept``, ``kept_completions``, ``update_kept``, ``label_version`` and
``abort_kept`` (:class:`~rlflow.rollout.engines.server.ServerEngine` does, and
:class:`~rlflow.rollout.engines.fleet.FleetEngine` over such servers); ``keep_unavailable`` says why not.
"""

from __future__ import annotations

import dataclasses


def keeps_requests(engine) -> str | None:
    """Why ``engine`` cannot keep requests across a weight update (``None``: it can)."""
    return engine.keep_unavailable()


def drive_kept(fa) -> None:
    """The driver loop of ``fa`` (a FullyAsyncRollout, its state under ``fa._cond``): admit groups as the
    pacing allows and send each as one request, load pushed weights with the requests kept, and move every
    group whose request answered to the complete ones. Returns when ``fa`` stops; raises what a request raised."""
    engine, params = fa.engine, fa.rollout.sampling
    engine.label_version(fa._engine_version)  # so the first tokens are labelled with rlflow's version
    pending: dict = {}  # future -> (request id, group)

    def wake(_future) -> None:
        with fa._cond:
            fa._cond.notify_all()

    try:
        while True:
            with fa._cond:
                while not fa._stopping and fa._weights is None and not any(f.done() for f in pending) and not (
                        fa._queue and fa.batch_size is not None and fa._room() > 0):
                    fa._cond.wait()
                if fa._stopping:
                    return
                weights, fa._weights = fa._weights, None
                admitted = fa._admit() if weights is None else []
                answered = [f for f in pending if f.done()]
            if weights is not None:
                version, pairs = weights
                engine.update_kept([pairs], version)
                fa._engine_version = version
            for group in admitted:
                rid, future = engine.submit_kept(group.samples[0].prompt,
                                                 dataclasses.replace(params, n=len(group.samples)), fa._engine_version)
                pending[future] = (rid, group)
                future.add_done_callback(wake)
            for future in answered:
                _, group = pending.pop(future)
                completions = engine.kept_completions(future.result())
                if len(completions) != len(group.samples):
                    raise RuntimeError(f"{type(engine).__name__} returned {len(completions)} completions for a "
                                       f"request of {len(group.samples)} samples")
                for sample, completion in zip(group.samples, completions):
                    sample.tokens, sample.log_probs = list(completion.token_ids), list(completion.log_probs)
                    sample.versions, sample.finish = list(completion.extras["token_versions"]), completion.finish_reason
            if answered:
                fa._hand_over_finished()
    finally:  # a stopped run: its groups go back to the queue, so nobody reads these answers
        unread = [rid for future, (rid, _) in pending.items() if not future.done()]
        try:
            engine.abort_kept(unread)
        except Exception:  # noqa: BLE001 - best effort: an unread request only costs the server its tokens
            pass


__all__ = ["drive_kept", "keeps_requests"]
