"""rlflow.tasks"""
