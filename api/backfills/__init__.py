"""/v1/backfills: a dataset in (NDJSON), progress, results out, cancel.

``routes`` over ``service`` (the streamed upload, reads, cancel); ``schemas`` holds
the bodies. The backfill itself (its rows, the feeder's work) is core.db.backfills'.
"""
