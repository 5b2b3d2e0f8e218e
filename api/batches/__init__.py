"""OpenAI's Files and Batch APIs over Ferry's backfills.

``routes`` over ``service`` (run off the event loop); ``lines`` turns request lines
into jobs and results into OpenAI's output and error lines.
"""
