"""Data parallelism: N scheduler replicas behind one entry point, and the controller that picks one per request."""
