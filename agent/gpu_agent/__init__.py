"""gpu-agent: tells the truth about a node's GPUs and never serves work it cannot run.

Layers import downward only (checked by import-linter, see pyproject.toml):

    cli          -> parses flags, picks a role
    roles        -> cluster agent, node agent, control plane, local (all-in-one)
    mechanisms   -> inventory (GPU sources + monitor), registration, queues
    foundations  -> clock, config, logging, health, metrics, secrets, control-plane client
"""

__version__ = "0.2.0"
