"""The OpenAI-compatible sidecar (`openalice-runner serve`): FastAPI app over a Runner.

from openalice_runner.server.app import create_app, ServerSettings
"""
