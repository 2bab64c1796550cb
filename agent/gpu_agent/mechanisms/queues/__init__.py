"""Work queues: lease from the control plane only while open, execute idempotently, ack."""
