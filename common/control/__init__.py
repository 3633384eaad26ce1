"""Runtime control of a running engine: weight updates, memory release and resume, pause and slow-down."""
