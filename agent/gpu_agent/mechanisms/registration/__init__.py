"""Registration with the control plane: one gate, backoff with jitter, a generation guard."""
