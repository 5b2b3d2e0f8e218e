"""Configuration: the typed settings every Ferry process reads, and their reference page.

``settings`` holds one ``Settings`` object built from ``FERRY_*`` variables (and
per-model overrides from the repository's model.toml); ``reference`` renders
docs/settings.md from it. Imports nothing else of Ferry's: everything may import it.
"""
