from agents.modules.actor_critic import CausalLMActorCritic

__all__ = ["CausalLMActorCritic"]
