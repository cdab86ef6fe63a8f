"""Rollout: an env's episode played by a model, token in and token out.

``manager`` (GenerationManager: the multi-turn loop, logprobs), ``writer`` (an episode's
token ids and loss mask, written the same way for rollouts, demonstrations and agents),
``chat`` (chat templates applied turn by turn without re-tokenising history), ``engines/`` (the
in-process HF engine with continuous batching and prefix cache, the SGLang client and its
launcher) and ``runtime`` (building the engine, the envs and the manager from a config).
It may import ``agentgym.core``, ``agentgym.config``, ``agentgym.models``, ``envs`` and
``tools``.
"""
