"""Training backends behind one protocol (see ``trainers.backends.base``)."""
