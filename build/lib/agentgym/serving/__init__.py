"""``agentgym serve``: the HF engine behind SGLang's native HTTP API and OpenAI's
``/v1/chat/completions`` (``serve``). It may import ``agentgym.core``, ``agentgym.models``
and ``agentgym.rollout``.
"""
