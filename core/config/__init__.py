"""Configuration: the typed settings every Ferry process reads, and their reference page.

``settings`` holds one ``Settings`` object built from ``FERRY_*`` variables (and
per-model overrides from the repository's model.toml); ``reference`` renders
docs/settings.md from it. The batching knobs among the settings are derived from
their one definition, the scheduler's ``Tuning`` (scheduler.learning, pure); it imports
nothing else of Ferry's, and everything may import it.
"""
