"""Engine servers (``ServerProcess`` subclasses) with their command line and environment only: no process starts."""

import tempfile


def unstarted(cls, config, device: str | None = None, api_key: str = "k" * 43, secrets: str | None = None):
    """A ``cls`` server for ``config`` on port 1234 serving ``policy``, as ``__init__`` would set it up, unstarted.

    ``device``: the resolved device, for servers whose command depends on it (SGLang); ``secrets``: the private
    directory its key file goes to (a new temporary one when None).
    """
    server = cls.__new__(cls)
    server.config, server.model_name, server.port, server.api_key = config, "policy", 1234, api_key
    server._secrets = secrets or tempfile.mkdtemp()
    if device is not None:
        server.device = device
    return server
