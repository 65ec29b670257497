from project.callbacks.prediction_writer import PredictionCsvWriter
from project.callbacks.reseed import ReseedEachEpoch

__all__ = ["PredictionCsvWriter", "ReseedEachEpoch"]
