"""Bridges to other libraries' trainers. Each lives in its own module and imports its library only there.

* :mod:`twinkle_core.integrations.trl`: TRL's ``GRPOTrainer`` with twinkle generating
  (``pip install "twinkle-core[trl]"``).
"""
