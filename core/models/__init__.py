"""The model repository: what Ferry knows of each model it serves, without any backend.

The folders and their typed configuration (``repository``), the reading of
model.toml with every problem named by file and field (``reader``), input kinds
with their checks and prices (``inputs``, ``generation`` with its chat templates
in ``chat``), what the API knows of each model it takes jobs for (``catalog``),
and the wait estimates its workers learn (``estimates``,
``generation_estimates``). Imports nothing else of Ferry's but the scheduler's
vocabulary; ``reader`` builds on ``repository``, never the other way.
"""
