"""Launchers that place rlflow's training processes past one machine (:mod:`rlflow.launch.ray`: a Ray cluster)."""
