"""Build identity, stamped into the image at build time through the environment."""

from __future__ import annotations

import os

from gpu_agent import __version__


def version_info() -> dict[str, str]:
    return {
        "version": __version__,
        "commit": os.environ.get("GPU_AGENT_BUILD_COMMIT", "unknown"),
        "buildDate": os.environ.get("GPU_AGENT_BUILD_DATE", "unknown"),
    }
