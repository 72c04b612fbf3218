"""rlflow.models"""
