"""The model zoo: ``zoo`` (names -> local HF folders, loading policies, value models and
tokenizers; nothing is downloaded at run time), ``tiny`` (random Qwen2 / Qwen2-VL models
built locally in seconds), ``shapes`` (published model configs), ``plan`` (the memory
planner) and ``vision`` (image inputs for VL models). It may import ``agentgym.core``.
"""
