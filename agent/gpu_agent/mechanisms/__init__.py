"""Mechanisms: inventory, registration and queues. Each uses foundations only, never another mechanism;
the roles wire them together."""
