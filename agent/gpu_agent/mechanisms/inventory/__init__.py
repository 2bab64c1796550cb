"""GPU inventory: sources (NVML, fake file) behind one interface, read by one monitor."""
