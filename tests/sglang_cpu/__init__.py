"""SGLang 0.5.23's own server code on CPU (see launch_server.py). Importing the package installs
the stand-ins for the few off-path modules that cannot import here (stubs.py) -- first, so that
spawned scheduler processes have them before they unpickle SGLang objects."""
from . import stubs

stubs.install()
