"""Training backends behind one protocol (see ``agentgym.trainers.backends.base``)."""
