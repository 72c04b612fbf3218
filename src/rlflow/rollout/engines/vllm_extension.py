"""Registers rlflow's weight-transfer backend inside vLLM's own worker processes.

vLLM's ``WeightTransferEngineFactory`` keeps its registry per process, and a vLLM server creates the
weight-transfer engine in its engine-core process, which it starts with ``spawn``: a registration made
in the process that launched the server never reaches it. vLLM imports the module of
``--worker-extension-cls`` in every worker before it loads the model, so naming this module's class
there (:func:`rlflow.rollout.engines.weight_transfer.server_arguments` does) registers ``rlflow_shm``
where the engine is created. The class adds no methods.
"""

from rlflow.rollout.engines.weight_transfer import register

register()


class WeightTransferExtension:
    """Empty: importing this module is what matters (see the module docstring)."""
