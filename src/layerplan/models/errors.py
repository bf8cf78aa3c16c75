"""The error of a model that cannot be found or run, in a module of its own: the light front end
(layerplan/lite/) raises it without importing torch."""


class ModelError(ValueError):
    """A model that cannot be found or is not supported; the message says what was looked for."""
