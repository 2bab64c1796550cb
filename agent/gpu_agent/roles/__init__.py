"""Roles: the processes gpu-agent runs as. Each wires mechanisms and foundations together."""
