"""What tests and benchmarks start Ferry, Redis, PostgreSQL and proxies with.

Plain Python, without pytest: the benchmarks run without it. A service that is
neither reachable nor startable raises ``services.ServiceMissing``; the test
suite turns that into a skip, or a failure under CI=true.

- ``services``: a Redis found or started, a fresh PostgreSQL database.
- ``postgres``: PostgreSQL servers of a test's own (initdb), to stop, restart and fail over.
- ``stack``: ``ferry up`` in a directory of its own (``FerryUp``).
- ``served``: the API app in uvicorn on a free port, in a thread (``Served``).
- ``processes``: ``python -m ferry ...`` processes, logged, supervised, killed.
- ``proxy``: a TCP proxy that can cut a service off and restore it.
- ``listener``: who the workers announced as recorded, and how many times.
- ``submitting``: bursts of submissions that retry as a careful client would.
- ``witness``: the transition log a trigger keeps in a test's database.
- ``lm_witness``: what a causal LM in a worker process was fed, call by call.
- ``accounting``: what a scenario submitted, completed, lost, computed and wrote twice,
  counted from the witnesses.
- ``faults``: the fault suite's stack of separate processes around them all.
"""

POLL_S = 0.05  # seconds between two looks at something the harness waits for
