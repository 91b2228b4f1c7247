"""What every operator file (policies/*.yaml, providers/*.yaml) is read with: YAML that remembers where
each value sits (yaml_nodes.py), strict pydantic models (models.py), and one error type whose problems
read FILE:LINE:COL (errors.py).
"""

from openalice_runner.config_files.errors import ConfigError, Problem
from openalice_runner.config_files.models import StrictModel
from openalice_runner.config_files.yaml_nodes import Located, Path, load_located

__all__ = ["ConfigError", "Located", "Path", "Problem", "StrictModel", "load_located"]
