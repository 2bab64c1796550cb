"""Fake GPUs for machines and clusters without any.

The state file format is the agent's own (`gpu_agent.foundations.fake_state`): the agent's
fake source reads it through the same code path and inventory shape as NVML.
"""
