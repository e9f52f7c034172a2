from agents.modules.actor_critic import CausalLMActorCritic
from agents.modules.seq2seq import Seq2SeqActorCritic

__all__ = ["CausalLMActorCritic", "Seq2SeqActorCritic"]
