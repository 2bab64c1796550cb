"""The node agent as a DRA driver: this node's GPUs offered through `resource.k8s.io/v1`.

    inventory ──> devices.py (a GPU -> a slice device: name by index, attributes, health as a taint)
              ──> slices.py (one pool per node; generation bumped on change; recreated when wiped)
    kubelet ──(plugin.py: registration socket, DRA v1 / v1beta1 gRPC)──> prepare.py (claim fetched, configs
              decoded strictly by config.py) ──> checkpoint.py (started / completed / aborted) ──> cdi.py

Kubernetes allocates (the scheduler and the resourceclaim controller); this driver only publishes
what the node has and prepares what was allocated to it. `driver.py` puts the pieces together for
the node agent and owns their lifetimes.
"""
