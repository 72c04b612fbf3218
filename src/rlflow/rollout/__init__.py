"""rlflow.rollout"""
