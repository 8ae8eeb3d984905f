"""The training engine: SFT, reward model and PPO loops, checkpoints and generation.

It imports nothing of the service (no web, queue or database code) and reads no environment:
config comes in as arguments and results leave through :class:`engine.callbacks.Callbacks`.
"""
