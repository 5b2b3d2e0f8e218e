"""/v1/models (OpenAI's list and model objects, with Ferry's own fields) and health.

``routes`` answers them; ``schemas`` holds the model objects.
"""
