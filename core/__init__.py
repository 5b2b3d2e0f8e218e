"""What every Ferry process shares, in five sub-packages by kind.

``config`` (the settings), ``models`` (the model repository), ``streams``
(Redis), ``db`` (the database) and ``ops`` (logs, metrics, traces). Each one's
``__init__`` says what lives there and what it may import; tests/unit/test_layout.py
holds them to it. Nothing here imports the API, the workers or a backend.
"""
