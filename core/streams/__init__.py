"""Redis and its streams: everything that reaches Ferry's Redis.

How every part finds it (``target``: one URL, the primary Sentinel names, or a
cluster; and the server's clock), the key names, message protocol and scripts
(``protocol``), each model's queue depth (``queues``) and bounds (``bounds``), a
job's events stream (``events``) and the Celery apps on the same Redis
(``broker``). May import ``core.config``; no SQL here.
"""
