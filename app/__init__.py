"""The Llamba desktop chat window (`python -m app`, or the `llamba` launcher)."""
from runtime import __version__  # one version number, pyproject's  # noqa: F401
