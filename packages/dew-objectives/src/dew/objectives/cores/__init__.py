"""Parts shared by two families or more, importing only the contract: the causal-LM
policy and its reference (``policy``), RL maths (``rl``), rollouts, log-probs, rewards
and the text-encoder component of conditioned models (``conditioning``)."""
