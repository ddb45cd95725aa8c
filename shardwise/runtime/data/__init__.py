"""What decides which data a step trains on: curriculum learning's difficulty schedule."""
