"""The error a bad setting raises, wherever it is found: in the config's own checks, or in a room
that meets the setting only when it runs (an engine argument vLLM does not know). The CLI turns it
into exit code 2. Imports nothing; `cadence.config.ConfigError` is this class."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""
