"""What a run reports: ``metrics`` (JSONL, TensorBoard, curve PNGs, W&B), ``evaluation``
(EM, pass@k, maj@k of ``agentgym eval``), ``stats`` (intervals, pass@k, the paired exact
McNemar test) and ``inspector`` (the HTML page of ``agentgym inspect``). It may import
``agentgym.core``, ``agentgym.rollout`` and ``envs``.
"""
