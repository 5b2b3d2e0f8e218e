"""OpenAI's embeddings, completions and chat completions, as Ferry's jobs.

``routes`` over ``completions`` (what the generation routes do); ``generation``
maps OpenAI's request fields to a generation job, ``embeddings`` shapes vectors as
OpenAI gives them, ``schemas`` holds the bodies.
"""
