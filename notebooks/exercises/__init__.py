"""Exercise checks and reference solutions, one module per notebook; ``checking`` holds what the
checks share."""
