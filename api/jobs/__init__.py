"""/v1/jobs: submit, read (long-poll and events), cancel, list; and the key's webhook secret.

``routes`` (and ``webhook_routes``) parse, authorise and answer; ``service`` does
what they ask, callable without HTTP; ``submissions`` and ``reads`` write and read
jobs in groups; ``events`` streams a job's events; ``schemas`` holds the bodies.
"""
