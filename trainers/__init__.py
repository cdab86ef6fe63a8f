"""Training: ``agentgym train``'s entry and step loop (``loop.py``: :func:`agentgym.trainers.
loop.train`), SFT (``sft.py``), the algorithms (``algos.py``), the critic (``critic.py``)
and the backends (``backends/``)."""
