"""Errors a user can cause. Each names the value, the place and the fix."""


class HybridparError(ValueError):
    """Base class: bad input to hybridpar (a config, a mesh, a model, a plan)."""


class MeshError(HybridparError):
    """Parallel degrees that do not fit the world size or each other."""


class GeometryError(HybridparError):
    """A spatial split that cannot be computed exactly (a slab thinner than its halo, ...)."""


class UnsupportedModuleError(HybridparError):
    """A module or function that hybridpar cannot make exact under spatial parallelism."""


class DataError(HybridparError):
    """A data file that is missing, malformed or truncated; names the file and the sample index."""


class ConfigError(HybridparError):
    """A training config with an unknown key or a bad value; names the key."""


class ClusterError(HybridparError):
    """A cluster description (preset name, TOML file or ClusterSpec field) that is unknown or out of range."""


class PlanError(HybridparError):
    """A model the planner cannot analyse, a plan that does not fit its model or cluster, or no plan at all."""


class CheckpointError(HybridparError):
    """A checkpoint that is damaged, crafted or of another layout; names the folder and the file."""


class TrainingError(HybridparError):
    """A run that cannot go on: a NaN or infinite loss or weights; names the step and the rank."""


class RunStopped(Exception):
    """A run that ended early for a cause outside its input (a worker that died, a signal): the command prints
    the message (where the run stands, how to go on) and exits with ``exit_code``, without a traceback."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
