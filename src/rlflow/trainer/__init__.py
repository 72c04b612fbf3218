"""rlflow.trainer"""
