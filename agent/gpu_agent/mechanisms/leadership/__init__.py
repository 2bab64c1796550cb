"""Leader election: which cluster agent is the active one."""
