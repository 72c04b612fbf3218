"""rlflow.data"""
