from project.callbacks.reseed import ReseedEachEpoch

__all__ = ["ReseedEachEpoch"]
