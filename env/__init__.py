"""Gymnasium side of the project: the token-generation env, tasks and rewards (no RLlib)."""
import gymnasium as gym

ENV_ID = "TokenGeneration-v0"

if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point="env.text_env:TokenGenerationEnv")
