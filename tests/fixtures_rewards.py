"""Reward functions for tests, loaded by import path like a user's own (`module:function`)."""


def even_length(prompt: str, completion: str, answer: str) -> float:
    """1 for a completion of even length: gives an untrained model's groups a spread of rewards."""
    return 1.0 if len(completion) % 2 == 0 else 0.0
