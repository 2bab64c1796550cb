"""Domain formation: each node agent keeps its own entry in one shared GPUDomain object."""
