"""What a checkpoint that cannot be loaded raises: each error names the file and the problem."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (base of the errors below)."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the config requires is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all.
        return str(self.args[0]) if self.args else ""


class TensorShapeError(CheckpointError):
    """A tensor has a shape that disagrees with config.json."""


class CorruptCheckpointError(CheckpointError):
    """A safetensors file whose header or size is inconsistent."""


class NoSafetensorsError(CheckpointError, FileNotFoundError):
    """The directory has a config.json but no weights jspec can read."""
