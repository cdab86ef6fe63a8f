"""Training: ``agentgym train``'s entry and step loop (``loop.py``: :func:`agentgym.trainers.
loop.train`), SFT (``sft.py``), the algorithms (``algos.py``), the critic (``critic.py``)
and the backends (``backends/``)."""

from __future__ import annotations

from agentgym._compat import serve_old_name

serve_old_name(__name__)  # `import trainers`, the old name: it now is agentgym.trainers

