"""The reference control plane: registration, credentials, a durable work queue, fault injection."""
