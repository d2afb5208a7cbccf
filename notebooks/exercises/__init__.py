"""Exercise checks and reference solutions, one module per notebook."""
