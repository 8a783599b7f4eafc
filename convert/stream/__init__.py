"""The float plan, its sources, and the one ordered, bounded chunk loop that writes them."""
