"""RLOO training: data, models, rewards, generation, the trainer loop."""
