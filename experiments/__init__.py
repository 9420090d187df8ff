"""Experiment configs: Python files whose `get_config(arg)` returns an ml_collections.ConfigDict."""
