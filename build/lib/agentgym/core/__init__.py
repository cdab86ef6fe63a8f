"""The ground floor: what every other layer, envs and tools included, may import.

``types`` (Trajectory, Segment, SamplingParams: the token-in/token-out contract),
``registry`` (name -> implementation tables), ``paths`` (cache and data folders),
``server_process`` (child servers that end with their parent), ``device`` (where models
and tensors go) and ``memory`` (glibc's allocator told to give memory back). It imports
nothing of the project.
"""
