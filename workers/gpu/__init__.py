"""The GPU worker: one process per model and device, draining its streams in micro-batches."""
