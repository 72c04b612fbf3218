"""verl's side of the config: its vendored YAML tree (``trainer_config/``, unchanged) and the translation of a verl
command into a component tree (:mod:`rlflow.config.verl.tree`)."""
