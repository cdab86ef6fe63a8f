"""The ground floor: what every other layer, envs and tools included, may import.

``types`` (Trajectory, Segment, SamplingParams: the token-in/token-out contract),
``registry`` (name -> implementation tables), ``choices`` (the names a config may choose),
``paths`` (cache and data folders), ``device`` (where models and tensors go) and ``memory``
(glibc's allocator told to give memory back). It imports nothing of the project; process
and thread supervision is the floor above (:mod:`agentgym.supervision`).
"""
