"""Finding where two runs part: bisect over steps, op traces and checkpoint state."""
